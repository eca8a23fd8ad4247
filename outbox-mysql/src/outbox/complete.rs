//! Completions and releases (the relay's role): outcomes applied under the claimed
//! aggregates' state-row locks, only where the claim still owns the row (fencing).

use std::collections::{HashMap, HashSet};

use chrono::NaiveDateTime;
use sqlx::{MySqlConnection, Row};
use uuid::Uuid;

use outbox_core::{
    AckMetadata, ClaimHandle, ClaimMode, CompletionReport, Outcome, StoreError, StoreErrorKind,
};

use super::claim::ClaimedRow;
use super::head::{in_list, marks, Key, NO_TOKEN};
use super::tx::{self, begin, finish, micros};
use super::MySqlOutboxStore;
use crate::error::db;

/// Longest delay a completion records.
const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// Longest acknowledged destination or route (bytes) passed through a `JSON_TABLE` `TEXT`
/// column, its capacity: a longer value would be cut there silently.
const MAX_JSON_TOPIC: usize = 65_535;

/// Bytes of acknowledgements per joined `UPDATE` (a quarter of the default
/// `max_allowed_packet`, as appends do).
const MAX_ACK_DOCUMENT: usize = 4 * 1024 * 1024;

/// What a lease claim's completion or release requires on each row it writes: the claim's
/// token, and the lease's end the claim wrote into the row's `next_attempt_at` (one reading of
/// the database clock, also the lease row's `until`). The next claim of a row whose lease
/// ended overwrites the token; a relay of the previous version (migration 3) that takes the
/// row over leaves the token but writes a later `next_attempt_at` (its own lease's end, then
/// its retry time or its release time, each read after this lease ended), so neither can be
/// completed by this claim. The claim's own writes of the row keep both.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fence {
    pub(crate) token: Uuid,
    pub(crate) until: NaiveDateTime,
}

impl MySqlOutboxStore {
    pub(super) async fn complete_inner(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        match self.inner.settings.claim_mode {
            ClaimMode::LockedTransaction => {
                let taken = self
                    .inner
                    .locked
                    .lock()
                    .expect("poisoned")
                    .remove(&claim.token);
                let Some(mut held) = taken else {
                    // Unknown token: the claim ended (released, timed out) or belongs to
                    // another store instance. Nothing applied; every outcome is refused.
                    return Ok(CompletionReport::new(
                        0,
                        outcomes.iter().map(Outcome::event_id).collect(),
                    ));
                };
                // The claim's transaction holds the aggregates' locks since the claim.
                let rows = std::mem::take(&mut held.rows);
                let lasts = std::mem::take(&mut held.lasts);
                let owned: HashSet<i64> = rows.iter().map(|r| r.id).collect();
                let applied = self
                    .apply(held.held.conn(), &rows, outcomes, &owned, &lasts, None)
                    .await
                    .map_err(lost_claim);
                match applied {
                    Ok(applied) => {
                        held.held.end(true).await.map_err(lost_claim)?;
                        Ok(report(outcomes, &rows, &applied))
                    }
                    // Dropping the claim closes its connection: the server rolls back.
                    Err(e) => Err(e),
                }
            }
            _ => {
                let (rows, fence) = self.lease_rows(claim.token).await?;
                let Some(fence) = fence else {
                    return Ok(report(outcomes, &rows, &[]));
                };
                let applied =
                    tx::retry_lock_conflicts!(self.complete_lease(&rows, outcomes, &fence).await)?;
                Ok(report(outcomes, &rows, &applied))
            }
        }
    }

    pub(super) async fn release_inner(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        match self.inner.settings.claim_mode {
            ClaimMode::LockedTransaction => {
                let taken = self
                    .inner
                    .locked
                    .lock()
                    .expect("poisoned")
                    .remove(&claim.token);
                if let Some(held) = taken {
                    if let Err(e) = held.held.end(false).await {
                        // The connection is closed, and its locks are gone with it.
                        tracing::warn!(error = %e, "rollback of a released claim failed");
                    }
                }
                Ok(())
            }
            _ => {
                let (rows, fence) = self.lease_rows(claim.token).await?;
                let Some(fence) = fence.filter(|_| !rows.is_empty()) else {
                    return Ok(());
                };
                tx::retry_lock_conflicts!(self.release_lease(&rows, &fence).await)
            }
        }
    }

    /// One transaction of a lease completion.
    async fn complete_lease(
        &self,
        rows: &[ClaimedRow],
        outcomes: &[Outcome],
        fence: &Fence,
    ) -> Result<Vec<i64>, StoreError> {
        let mut tx = begin(&self.inner.pool).await?;
        let applied = async {
            // Serialized with claims and operator actions on the same aggregates: a claim
            // decides after it holds these locks.
            let (owned, lasts) = self.owned_rows(&mut tx, rows, fence).await?;
            self.apply(&mut tx, rows, outcomes, &owned, &lasts, Some(fence))
                .await
        }
        .await;
        finish(tx, applied).await
    }

    /// One transaction of a lease release.
    async fn release_lease(&self, rows: &[ClaimedRow], fence: &Fence) -> Result<(), StoreError> {
        let mut tx = begin(&self.inner.pool).await?;
        let done = async {
            let (owned, _) = self.owned_rows(&mut tx, rows, fence).await?;
            self.end_lease_claim(&mut tx, rows, &owned, &HashSet::new(), fence)
                .await
        }
        .await;
        finish(tx, done).await
    }

    /// Locks the aggregates of `rows` (blocking, in key order: serialized with claims, which
    /// decide under these locks, and with operator actions) and returns the rows this claim
    /// may still own, and the aggregates' `last_version` (read by the locking read itself:
    /// the latest committed value, which nobody else changes while the lock is held).
    ///
    /// Whether the claim still owns a row is decided by the row itself: every statement of the
    /// completion that writes it requires the claim's token on it (`claim_token`), which the
    /// next claim of the row, after the lease ended, overwrites. Excluded here are the rows a
    /// relay of the previous version took over (a rolling upgrade: it leased the row in the
    /// state row and leaves the token), and rows at or below their aggregate's last version
    /// (another claim published that version through another copy of it).
    async fn owned_rows(
        &self,
        conn: &mut MySqlConnection,
        rows: &[ClaimedRow],
        fence: &Fence,
    ) -> Result<(HashSet<i64>, HashMap<Key, Option<i64>>), StoreError> {
        if rows.is_empty() {
            return Ok((HashSet::new(), HashMap::new()));
        }
        let mut keys: Vec<&Key> = rows.iter().map(|r| &r.key).collect();
        keys.sort();
        keys.dedup();
        let sql = format!(
            "SELECT aggregate_key, lease_token, lease_row, last_version, \
                    UTC_TIMESTAMP(6) >= ? AS lease_ended \
             FROM {} FORCE INDEX (PRIMARY) \
             WHERE {} ORDER BY aggregate_key FOR UPDATE",
            self.inner.tables.state,
            in_list("aggregate_key", keys.len())
        );
        let mut q = sqlx::query(&sql).bind(fence.until);
        for k in &keys {
            q = q.bind(*k);
        }
        let states = q.fetch_all(&mut *conn).await.map_err(db)?;
        if states.len() != keys.len() {
            // Cannot happen (the store never deletes a state row; the claim read each one
            // under its lock): refuse rather than apply outcomes under no aggregate lock.
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "locked {} of the {} state rows of the claimed aggregates: a state row was \
                     missing",
                    states.len(),
                    keys.len()
                ),
            ));
        }
        let mut legacy = HashSet::new();
        let mut lasts = HashMap::with_capacity(states.len());
        let mut lease_ended = false;
        for s in &states {
            lease_ended |= s.try_get::<i64, _>("lease_ended").map_err(db)? != 0;
            let t: Option<Uuid> = s.try_get("lease_token").map_err(db)?;
            let row: Option<i64> = s.try_get("lease_row").map_err(db)?;
            if let (Some(_), Some(row)) = (t, row) {
                legacy.insert(row);
            }
            lasts.insert(
                s.try_get::<Vec<u8>, _>("aggregate_key").map_err(db)?,
                s.try_get::<Option<i64>, _>("last_version").map_err(db)?,
            );
        }
        // After this lease ended, a row at or below its aggregate's last version was taken
        // over: another claim of the aggregate published that version (or a later one)
        // through another copy of it (a claim of a different row leaves this row's token in
        // place). Its outcomes are refused: applied, its publication would record the version
        // published twice, and a retry or park would act on a row the next claim parks as out
        // of order (adversary_takeover45). While the lease lasts no claim takes the aggregate,
        // and `last` reaches the row's version only through an operator (a discarded copy of
        // the version): its outcomes apply as before.
        let owned = rows
            .iter()
            .filter(|r| !legacy.contains(&r.id))
            .filter(|r| {
                !(lease_ended
                    && matches!(lasts.get(&r.key), Some(Some(last)) if r.version <= *last))
            })
            .map(|r| r.id)
            .collect();
        Ok((owned, lasts))
    }

    /// Applies each outcome to its row where the claim owns it (`owned`) and the row is still
    /// pending (with `fence`, a lease claim's token: and still carries it); advances the last
    /// version on a publication (one state-row upsert); in lease mode ends the claim (rows
    /// without an outcome due again, the lease row deleted); unblocks what follows. `lasts`:
    /// the aggregates' `last_version` as read under the locks this transaction holds (an
    /// aggregate missing there is read again). Returns the ids of the rows an outcome was
    /// applied to.
    async fn apply(
        &self,
        conn: &mut MySqlConnection,
        rows: &[ClaimedRow],
        outcomes: &[Outcome],
        owned: &HashSet<i64>,
        lasts: &HashMap<Key, Option<i64>>,
        fence: Option<&Fence>,
    ) -> Result<Vec<i64>, StoreError> {
        let by_event: HashMap<Uuid, &Outcome> = outcomes
            .iter()
            .rev()
            .map(|o| (o.event_id().as_uuid(), o))
            .collect();
        let t = &self.inner.tables;
        let mut applied = Vec::new();
        // A lease claim's outcome ends its claim of the row (the token goes) and applies only
        // where the row still carries the claim's token and lease end.
        let (fence_set, fence_where) = if fence.is_some() {
            (
                format!(", claim_token = {NO_TOKEN}"),
                " AND claim_token = ? AND next_attempt_at = ?",
            )
        } else {
            (String::new(), "")
        };
        let retry_sql = format!(
            "UPDATE {} SET attempts = attempts + ?, \
               next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
               last_error_class = ?, last_error_kind = ?, last_error_message = ?, \
               maybe_delivered = maybe_delivered OR ?{fence_set} \
             WHERE id = ? AND status = 'pending'{fence_where}",
            t.events
        );
        let park_sql = format!(
            "UPDATE {} SET status = 'parked', attempts = attempts + 1, \
               parked_at = UTC_TIMESTAMP(6), park_kind = ?, last_error_class = ?, \
               last_error_kind = ?, last_error_message = ?, \
               maybe_delivered = maybe_delivered OR ?{fence_set} \
             WHERE id = ? AND status = 'pending'{fence_where}",
            t.events
        );
        // Publications, the common outcome, are applied in a fixed number of statements
        // whatever the batch size (`mark_published`); retries and parks row by row.
        let mut publications: Vec<(&ClaimedRow, &AckMetadata)> = Vec::new();
        for row in rows.iter().filter(|r| owned.contains(&r.id)) {
            let Some(outcome) = by_event.get(&row.event) else {
                continue;
            };
            let q = match outcome {
                Outcome::Published { ack, .. } => {
                    publications.push((row, ack));
                    continue;
                }
                Outcome::Retry { delay, error, .. } | Outcome::Defer { delay, error, .. } => {
                    let count = i32::from(matches!(outcome, Outcome::Retry { .. }));
                    sqlx::query(&retry_sql)
                        .bind(count)
                        // A delay beyond a year is a policy bug; capped so the time cannot
                        // overflow.
                        .bind(micros((*delay).min(MAX_DELAY)))
                        .bind(error.class.as_str())
                        .bind(&error.kind)
                        .bind(&error.message)
                        .bind(error.delivery_uncertain())
                }
                Outcome::Park { reason, .. } => sqlx::query(&park_sql)
                    .bind(reason.kind.as_str())
                    .bind(reason.error.class.as_str())
                    .bind(&reason.error.kind)
                    .bind(&reason.error.message)
                    .bind(reason.error.delivery_uncertain()),
            };
            let mut q = q.bind(row.id);
            if let Some(f) = fence {
                q = q.bind(f.token).bind(f.until);
            }
            let n = q.execute(&mut *conn).await.map_err(db)?.rows_affected();
            if n == 1 {
                applied.push(row.id);
            }
        }
        let published = self.mark_published(conn, &publications, fence).await?;
        applied.extend(published.iter().map(|r| r.id));
        let done: HashSet<i64> = applied.iter().copied().collect();
        // The last version moves to the highest one published (never down), in one state-row
        // upsert; then the aggregate's next row becomes a candidate.
        let advanced = self.new_last_versions(conn, &published, lasts).await?;
        let moved: HashMap<Key, i64> = advanced.iter().cloned().collect();
        self.write_last_versions(conn, &moved).await?;
        if let Some(fence) = fence {
            self.end_lease_claim(conn, rows, owned, &done, fence)
                .await?;
        }
        self.promote(conn, &advanced).await?;
        Ok(applied)
    }

    /// Marks the rows of `publications` that are still pending as published with their
    /// acknowledgements, and returns them. Two statements for a batch whose acknowledgements
    /// take up to 4 MiB (one more per further 4 MiB, and one per topic over 65,535 bytes): their
    /// status is read (a plain read: the caller holds the locks every writer of these rows
    /// takes first, the aggregates' state rows, or in locked mode the rows themselves, so the
    /// status cannot change meanwhile; a locking read would also lock the record after the
    /// last id to end its range, and wait there on another claim's row), then one `UPDATE` joins
    /// the acknowledgements as a table (`JSON_TABLE`, MySQL 8.0.4+ / MariaDB 10.6+), on the
    /// rows found pending only, named by primary key alone (`id IN (..)` and
    /// `FORCE INDEX (PRIMARY)`, see [`super::tx`]): it reads no other row (a scan would wait
    /// on other claims' rows). Same rows, same values and the same
    /// `status = 'pending'` rule as one `UPDATE .. WHERE id = ? AND status = 'pending'` per
    /// row.
    ///
    /// With `fence` (a lease claim's token) there is no status read: the marking's own `WHERE`
    /// requires the token and `status = 'pending'` on each row (evaluated on the latest row
    /// version, under the row's lock), and writes a token of this completion's own into the
    /// rows it marks; its row count says whether every row was marked (the normal case), and
    /// only when some were not (taken over by another claim, or finished by an operator) one
    /// read by primary key finds the rows that carry this completion's token.
    async fn mark_published<'r>(
        &self,
        conn: &mut MySqlConnection,
        publications: &[(&'r ClaimedRow, &AckMetadata)],
        fence: Option<&Fence>,
    ) -> Result<Vec<&'r ClaimedRow>, StoreError> {
        if publications.is_empty() {
            return Ok(Vec::new());
        }
        let t = &self.inner.tables;
        let pending: HashSet<i64> = if fence.is_some() {
            publications.iter().map(|(row, _)| row.id).collect()
        } else {
            // A plain read after the locks (READ COMMITTED: the latest committed status), by
            // primary key only.
            let sql = format!(
                "SELECT id, CAST(status AS CHAR) FROM {} WHERE id IN ({})",
                t.events,
                marks(publications.len())
            );
            let mut q = sqlx::query_as::<_, (i64, String)>(&sql);
            for (row, _) in publications {
                q = q.bind(row.id);
            }
            q.fetch_all(&mut *conn)
                .await
                .map_err(db)?
                .into_iter()
                .filter(|(_, status)| status == "pending")
                .map(|(id, _)| id)
                .collect()
        };
        // Lease mode: the rows marked here carry this token afterwards (fixed width, written in
        // place), which no claim ever holds.
        let marker = Uuid::now_v7();
        let (fence_set, fence_where) = if fence.is_some() {
            (
                ", claim_token = ?",
                " AND claim_token = ? AND next_attempt_at = ?",
            )
        } else {
            ("", "")
        };
        let (marked, long): (Vec<(&'r ClaimedRow, &AckMetadata)>, Vec<_>) = publications
            .iter()
            .filter(|(row, _)| pending.contains(&row.id))
            .copied()
            .partition(|(_, ack)| {
                ack.destination().len().max(ack.route().map_or(0, str::len)) <= MAX_JSON_TOPIC
            });
        // A topic longer than a `JSON_TABLE` `TEXT` column would be cut there without an
        // error: such a row gets its own `UPDATE`, where the server refuses (strict mode) or
        // truncates (otherwise) a value too long for `ack_destination` as it always did.
        let mut done: Vec<&'r ClaimedRow> = Vec::new();
        for (row, ack) in long {
            let sql = format!(
                "UPDATE {} SET status = 'published', published_at = UTC_TIMESTAMP(6), \
                   finished_at = UTC_TIMESTAMP(6), ack_transport = ?, ack_destination = ?, \
                   ack_partition = ?, ack_position = ?, ack_route = ?, \
                   ack_duplicate = ?{fence_set} \
                 WHERE id = ? AND status = 'pending'{fence_where}",
                t.events
            );
            let mut q = sqlx::query(&sql)
                .bind(ack.transport().as_str())
                .bind(ack.destination())
                .bind(ack.position().and_then(|p| p.partition))
                .bind(ack.position().map(|p| p.offset))
                .bind(ack.route())
                .bind(ack.duplicate());
            if fence.is_some() {
                q = q.bind(marker);
            }
            q = q.bind(row.id);
            if let Some(f) = fence {
                q = q.bind(f.token).bind(f.until);
            }
            let n = q.execute(&mut *conn).await.map_err(db)?.rows_affected();
            if n == 1 {
                done.push(row);
            }
        }
        if marked.is_empty() {
            return Ok(done);
        }
        // One statement per 4 MiB of acknowledgements (the topics are the broker's, of any
        // length): a single document of a large batch could exceed the server's
        // `max_allowed_packet` (16 MiB by default) and be refused on every attempt.
        let mut chunks: Vec<(String, Vec<i64>)> = Vec::new();
        let (mut doc, mut ids) = (String::from("["), Vec::new());
        for (row, ack) in &marked {
            let position = ack.position();
            let item = serde_json::json!([
                row.id,
                ack.transport().as_str(),
                ack.destination(),
                position.and_then(|p| p.partition),
                position.map(|p| p.offset),
                ack.route(),
                ack.duplicate().map(i8::from),
            ])
            .to_string();
            if !ids.is_empty() && doc.len() + item.len() + 2 > MAX_ACK_DOCUMENT {
                doc.push(']');
                chunks.push((
                    std::mem::replace(&mut doc, String::from("[")),
                    std::mem::take(&mut ids),
                ));
            }
            if !ids.is_empty() {
                doc.push(',');
            }
            doc.push_str(&item);
            ids.push(row.id);
        }
        doc.push(']');
        chunks.push((doc, ids));
        let (json_set, json_where) = if fence.is_some() {
            (
                ", e.claim_token = ?",
                " AND e.status = 'pending' AND e.claim_token = ? AND e.next_attempt_at = ?",
            )
        } else {
            ("", "")
        };
        let mut n = 0;
        let mut short: Vec<i64> = Vec::new();
        for (doc, ids) in chunks {
            let sql = format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$[0]', \
                   transport VARCHAR(16) PATH '$[1]', dest TEXT PATH '$[2]', \
                   part INT PATH '$[3]', pos BIGINT PATH '$[4]', route TEXT PATH '$[5]', \
                   dup TINYINT PATH '$[6]')) a \
                 STRAIGHT_JOIN {} e FORCE INDEX (PRIMARY) ON e.id = a.id \
                 SET e.status = 'published', e.published_at = UTC_TIMESTAMP(6), \
                   e.finished_at = UTC_TIMESTAMP(6), e.ack_transport = a.transport, \
                   e.ack_destination = a.dest, e.ack_partition = a.part, \
                   e.ack_position = a.pos, e.ack_route = a.route, \
                   e.ack_duplicate = a.dup{json_set} \
                 WHERE {}{json_where}",
                t.events,
                in_list("e.id", ids.len()),
            );
            let mut q = sqlx::query(&sql).bind(doc);
            if fence.is_some() {
                q = q.bind(marker);
            }
            for id in &ids {
                q = q.bind(id);
            }
            if let Some(f) = fence {
                q = q.bind(f.token).bind(f.until);
            }
            let m = q.execute(&mut *conn).await.map_err(db)?.rows_affected();
            n += m;
            if m != ids.len() as u64 {
                short.extend(ids);
            }
        }
        if fence.is_some() && !short.is_empty() {
            // The rare path: some rows were no longer this claim's (another claim took them
            // over after the lease ended) or no longer pending (an operator finished them).
            // Those marked here carry the marker.
            let sql = format!(
                "SELECT id FROM {} WHERE id IN ({}) AND claim_token <> ?",
                t.events,
                marks(short.len())
            );
            let mut q = sqlx::query_scalar::<_, i64>(&sql);
            for id in &short {
                q = q.bind(id);
            }
            let missed: HashSet<i64> = q
                .bind(marker)
                .fetch_all(&mut *conn)
                .await
                .map_err(db)?
                .into_iter()
                .collect();
            done.extend(
                marked
                    .into_iter()
                    .filter(|(row, _)| !missed.contains(&row.id))
                    .map(|(row, _)| row),
            );
            return Ok(done);
        }
        if n != marked.len() as u64 {
            // Cannot happen under the locks taken above; refuse rather than report a
            // publication that was not recorded.
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "marked {n} of {} locked pending rows published",
                    marked.len()
                ),
            ));
        }
        done.extend(marked.into_iter().map(|(row, _)| row));
        Ok(done)
    }

    /// The new last version of each published aggregate that has a state row: the highest
    /// version published, never below its current one (`known`, read under the locks held;
    /// aggregates missing there are read now, in one statement). For `promote` and the
    /// state-row update.
    async fn new_last_versions(
        &self,
        conn: &mut MySqlConnection,
        published: &[&ClaimedRow],
        known: &HashMap<Key, Option<i64>>,
    ) -> Result<Vec<(Key, i64)>, StoreError> {
        if published.is_empty() {
            return Ok(Vec::new());
        }
        let mut highest: HashMap<&Key, i64> = HashMap::new();
        for row in published {
            let v = highest.entry(&row.key).or_insert(row.version);
            *v = (*v).max(row.version);
        }
        let missing: Vec<&Key> = highest
            .keys()
            .copied()
            .filter(|k| !known.contains_key(*k))
            .collect();
        let mut read: HashMap<Vec<u8>, Option<i64>> = HashMap::new();
        if !missing.is_empty() {
            let sql = format!(
                "SELECT aggregate_key, last_version FROM {} WHERE aggregate_key IN ({})",
                self.inner.tables.state,
                marks(missing.len())
            );
            let mut q = sqlx::query_as::<_, (Vec<u8>, Option<i64>)>(&sql);
            for k in &missing {
                q = q.bind(*k);
            }
            read = q
                .fetch_all(&mut *conn)
                .await
                .map_err(db)?
                .into_iter()
                .collect();
        }
        // An aggregate without a state row is left alone, as before.
        Ok(highest
            .iter()
            .filter_map(|(k, v)| {
                let current = known.get(*k).or_else(|| read.get(*k))?;
                Some(((*k).clone(), current.unwrap_or(0).max(*v)))
            })
            .collect())
    }

    /// Writes the new last versions, one multi-row upsert of the state rows. Each of these
    /// rows exists (this transaction holds its lock: since the claim in locked mode, since
    /// `owned_rows` in lease mode) and its last version moves up (a claimed head is above it),
    /// so each row is an update, counted 2 by the server: anything else fails the completion,
    /// which rolls back.
    async fn write_last_versions(
        &self,
        conn: &mut MySqlConnection,
        moved: &HashMap<Key, i64>,
    ) -> Result<(), StoreError> {
        if moved.is_empty() {
            return Ok(());
        }
        let mut rows: Vec<(&Key, i64)> = moved.iter().map(|(k, v)| (k, *v)).collect();
        rows.sort();
        let sql = format!(
            "INSERT INTO {} (aggregate_key, aggregate_type, aggregate_id, last_version, \
               updated_at) \
             VALUES {} \
             ON DUPLICATE KEY UPDATE last_version = VALUES(last_version), \
               updated_at = VALUES(updated_at)",
            self.inner.tables.state,
            vec!["(?, '', '', ?, UTC_TIMESTAMP(6))"; rows.len()].join(", ")
        );
        let mut q = sqlx::query(&sql);
        for (key, v) in &rows {
            q = q.bind(*key).bind(v);
        }
        let n = q.execute(&mut *conn).await.map_err(db)?.rows_affected();
        if n != 2 * rows.len() as u64 {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "writing the last versions changed {n} row counts for {} locked state rows \
                     (2 each expected): a state row was missing",
                    rows.len()
                ),
            ));
        }
        Ok(())
    }

    /// Lease mode: ends the claim `token`. An owned row that got no outcome (not in `done`)
    /// was made to wait for its lease by the claim: it is due again now, without the token
    /// (only where it still carries it); the batch's lease row is deleted.
    async fn end_lease_claim(
        &self,
        conn: &mut MySqlConnection,
        rows: &[ClaimedRow],
        owned: &HashSet<i64>,
        done: &HashSet<i64>,
        fence: &Fence,
    ) -> Result<(), StoreError> {
        let t = &self.inner.tables;
        let back: Vec<i64> = rows
            .iter()
            .filter(|r| owned.contains(&r.id) && !done.contains(&r.id))
            .map(|r| r.id)
            .collect();
        if !back.is_empty() {
            let sql = format!(
                "UPDATE {} SET next_attempt_at = UTC_TIMESTAMP(6), claim_token = {NO_TOKEN} \
                 WHERE id IN ({}) AND status = 'pending' AND claim_token = ? \
                   AND next_attempt_at = ?",
                t.events,
                marks(back.len())
            );
            let mut q = sqlx::query(&sql);
            for id in &back {
                q = q.bind(id);
            }
            q.bind(fence.token)
                .bind(fence.until)
                .execute(&mut *conn)
                .await
                .map_err(db)?;
        }
        sqlx::query(&format!("DELETE FROM {} WHERE token = ?", t.lease))
            .bind(fence.token)
            .execute(&mut *conn)
            .await
            .map_err(db)?;
        Ok(())
    }

    /// The rows of a lease claim and its lease's end: from memory (claimed here), else from
    /// the database (the pending rows that still carry the token and the end its lease row
    /// names; none when the lease row is gone: cleanup deletes it once the lease has ended).
    pub(super) async fn lease_rows(
        &self,
        token: Uuid,
    ) -> Result<(Vec<ClaimedRow>, Option<Fence>), StoreError> {
        let known = self.inner.leased.lock().expect("poisoned").remove(&token);
        if let Some((rows, until, _)) = known {
            return Ok((rows, Some(Fence { token, until })));
        }
        let t = &self.inner.tables;
        let until: Option<NaiveDateTime> =
            sqlx::query_scalar(&format!("SELECT until FROM {} WHERE token = ?", t.lease))
                .bind(token)
                .fetch_optional(&self.inner.pool)
                .await
                .map_err(db)?;
        let Some(until) = until else {
            return Ok((Vec::new(), None));
        };
        // The pending rows that still carry the token (no index on it: a range of
        // `claim_idx`, filtered; only a completion or release from another store instance
        // comes here).
        let rows = sqlx::query(&format!(
            "SELECT id, event_id, aggregate_key, aggregate_version \
             FROM {} WHERE status = 'pending' AND claim_token = ? AND next_attempt_at = ?",
            t.events
        ))
        .bind(token)
        .bind(until)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        let rows = rows
            .iter()
            .map(|r| {
                Ok(ClaimedRow {
                    id: r.try_get("id")?,
                    event: r.try_get("event_id")?,
                    key: r.try_get("aggregate_key")?,
                    version: r.try_get("aggregate_version")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(db)?;
        Ok((rows, Some(Fence { token, until })))
    }
}

/// The completion report: outcomes whose row was not updated were refused.
fn report(outcomes: &[Outcome], rows: &[ClaimedRow], applied: &[i64]) -> CompletionReport {
    let applied: HashSet<i64> = applied.iter().copied().collect();
    let applied_events: HashSet<Uuid> = rows
        .iter()
        .filter(|r| applied.contains(&r.id))
        .map(|r| r.event)
        .collect();
    let refused = outcomes
        .iter()
        .map(Outcome::event_id)
        .filter(|e| !applied_events.contains(&e.as_uuid()))
        .collect();
    CompletionReport::new(applied.len(), refused)
}

/// A lost connection under a locked claim means the claim is gone (the server rolled it back).
pub(super) fn lost_claim(e: StoreError) -> StoreError {
    if e.kind == StoreErrorKind::Connection {
        StoreError::new(
            StoreErrorKind::LeaseLost,
            format!("the locked claim's connection was lost: {}", e.message),
        )
        .with_source(e)
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection lost under a locked claim means the claim is gone; any other failure
    /// keeps its kind.
    #[test]
    fn a_lost_connection_under_a_locked_claim_is_a_lost_lease() {
        let e = lost_claim(StoreError::new(StoreErrorKind::Connection, "reset by peer"));
        assert_eq!(e.kind, StoreErrorKind::LeaseLost);
        assert!(e.message.contains("reset by peer"), "{}", e.message);
        let e = lost_claim(StoreError::new(StoreErrorKind::Conflict, "deadlock"));
        assert_eq!(e.kind, StoreErrorKind::Conflict);
    }
}
