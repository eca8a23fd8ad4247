//! Operator actions (the operator's role) on parked events, and on the claims of a relay that
//! is gone. Each runs under the event's aggregate lock, decides on a statement that starts
//! after it, and is audited in the same transaction.

use sqlx::mysql::MySqlRow;
use sqlx::{MySqlConnection, Row};
use uuid::Uuid;

use outbox_core::{
    AuditEntry, ClaimMode, ErrorClass, EventId, OperatorAction, ParkedEvent, StoreError,
    StoreErrorKind,
};

use super::head::{marks, Key, NO_TOKEN};
use super::rows::{parked_from_row, utc, ENVELOPE_COLS, PARKED_COLS};
use super::tx::{self, begin, finish};
use super::MySqlOutboxStore;
use crate::error::db;

/// An operator action on a parked event.
enum ParkedAction<'a> {
    Retry { actor: &'a str, reason: &'a str },
    Discard { actor: &'a str, reason: &'a str },
    Reissue { actor: &'a str, reason: &'a str },
}

/// An event's state as read after its aggregate's lock.
struct EventState {
    id: i64,
    key: Key,
    version: i64,
    /// The last version the claims count from: published or discarded, or for an aggregate
    /// without one 0 or (`accept_first_version`) one below its first version.
    last: i64,
    /// Unfinished rows of the aggregate between `last` and this event's version.
    waiting_below: i64,
    /// Byte lengths of the aggregate type and id.
    name_bytes: (usize, usize),
}

impl MySqlOutboxStore {
    /// Locks `event_id`'s aggregate in `conn` and reads the event's state after the lock.
    /// `NotFound` unless the event exists and is parked; `Conflict` while lower versions wait.
    async fn lock_parked(
        &self,
        conn: &mut MySqlConnection,
        event_id: EventId,
    ) -> Result<EventState, StoreError> {
        let t = &self.inner.tables;
        let before = sqlx::query(&format!(
            "SELECT aggregate_key, aggregate_type, aggregate_id FROM {} WHERE event_id = ?",
            t.events
        ))
        .bind(event_id.as_uuid())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db)?
        .ok_or_else(|| not_parked(event_id))?;
        let key: Vec<u8> = before.try_get("aggregate_key").map_err(db)?;
        let (agg_type, agg_id) = (
            crate::error::text(&before, "aggregate_type")?,
            crate::error::text(&before, "aggregate_id")?,
        );
        let name_bytes = (agg_type.len(), agg_id.len());
        self.lock_keys(conn, &[(key.clone(), agg_type, agg_id)])
            .await?;
        // The last version the claims count from (for an aggregate without one, what
        // `views` derives), so an operator accepts or refuses what a claim would.
        let last = self
            .views(conn, std::slice::from_ref(&key))
            .await?
            .get(&key)
            .map_or(0, |v| v.last_eff);
        let row = sqlx::query(&format!(
            "SELECT e.id, e.status, e.aggregate_version, \
                    (SELECT COUNT(*) FROM {ev} u \
                      WHERE u.aggregate_key = e.aggregate_key \
                        AND u.status IN ('pending', 'parked') AND u.id <> e.id \
                        AND u.aggregate_version > ? \
                        AND u.aggregate_version < e.aggregate_version) AS waiting_below \
             FROM {ev} e JOIN {st} a ON a.aggregate_key = e.aggregate_key \
             WHERE e.event_id = ?",
            ev = t.events,
            st = t.state
        ))
        .bind(last)
        .bind(event_id.as_uuid())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db)?
        .ok_or_else(|| not_parked(event_id))?;
        let status: String = crate::error::text(&row, "status")?;
        if status != "parked" {
            return Err(not_parked(event_id));
        }
        let state = EventState {
            id: row.try_get("id").map_err(db)?,
            key,
            version: row.try_get("aggregate_version").map_err(db)?,
            last,
            waiting_below: row.try_get("waiting_below").map_err(db)?,
            name_bytes,
        };
        if state.waiting_below > 0 {
            // Lower versions arrived after this event was parked (a gap that is filling):
            // accepting or dropping this version now would park them as out of order.
            return Err(versions_waiting(event_id, &state));
        }
        Ok(state)
    }

    /// Runs `action` for a parked event in a transaction holding its aggregate's lock, again
    /// after a deadlock. Returns the copy's id for a re-issue.
    async fn on_parked(
        &self,
        event_id: EventId,
        action: &ParkedAction<'_>,
    ) -> Result<Option<EventId>, StoreError> {
        tx::retry_lock_conflicts!(self.on_parked_once(event_id, action).await)
    }

    async fn on_parked_once(
        &self,
        event_id: EventId,
        action: &ParkedAction<'_>,
    ) -> Result<Option<EventId>, StoreError> {
        let mut tx = begin(&self.inner.pool).await?;
        let done = async {
            let s = self.lock_parked(&mut tx, event_id).await?;
            match action {
                ParkedAction::Retry { actor, reason } => {
                    self.retry_locked(&mut tx, event_id, (actor, reason), &s)
                        .await?;
                    Ok(None)
                }
                ParkedAction::Discard { actor, reason } => {
                    self.discard_locked(&mut tx, event_id, actor, reason, &s)
                        .await?;
                    Ok(None)
                }
                ParkedAction::Reissue { actor, reason } => self
                    .reissue_locked(&mut tx, event_id, actor, reason, &s)
                    .await
                    .map(Some),
            }
        }
        .await;
        finish(tx, done).await
    }

    async fn audit(
        &self,
        conn: &mut MySqlConnection,
        entry: (EventId, OperatorAction, &str, &str, Option<EventId>),
    ) -> Result<(), StoreError> {
        let (event_id, action, actor, reason, new_id) = entry;
        sqlx::query(&format!(
            "INSERT INTO {} (event_id, action, actor, reason, new_event_id, at) \
             VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6))",
            self.inner.tables.audit
        ))
        .bind(event_id.as_uuid())
        .bind(action.as_str())
        .bind(actor)
        .bind(reason)
        .bind(new_id.map(|e| e.as_uuid()))
        .execute(conn)
        .await
        .map_err(db)?;
        Ok(())
    }

    /// Raises the aggregate's last version to at least `to` and unblocks what follows.
    async fn raise_last(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        to: i64,
    ) -> Result<(), StoreError> {
        let t = &self.inner.tables;
        sqlx::query(&format!(
            "UPDATE {} SET last_version = GREATEST(COALESCE(last_version, 0), ?), \
               updated_at = UTC_TIMESTAMP(6) WHERE aggregate_key = ?",
            t.state
        ))
        .bind(to)
        .bind(key)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        let last: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT last_version FROM {} WHERE aggregate_key = ?",
            t.state
        ))
        .bind(key)
        .fetch_one(&mut *conn)
        .await
        .map_err(db)?;
        self.promote(conn, &[(key.clone(), last.unwrap_or(to))])
            .await
    }

    pub(super) async fn parked_event_inner(
        &self,
        event_id: EventId,
    ) -> Result<ParkedEvent, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT id, {ENVELOPE_COLS}, {PARKED_COLS} FROM {} \
             WHERE event_id = ? AND status = 'parked'",
            self.inner.tables.events
        ))
        .bind(event_id.as_uuid())
        .fetch_optional(&self.inner.pool)
        .await
        .map_err(db)?
        .ok_or_else(|| not_parked(event_id))?;
        parked_from_row(&row)
    }

    pub(super) async fn list_parked_inner(
        &self,
        limit: usize,
    ) -> Result<Vec<ParkedEvent>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT id, {ENVELOPE_COLS}, {PARKED_COLS} FROM {} \
             WHERE status = 'parked' ORDER BY parked_at, id LIMIT ?",
            self.inner.tables.events
        ))
        .bind(limit.min(i64::MAX as usize) as i64)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter().map(parked_from_row).collect()
    }

    pub(super) async fn retry_parked_inner(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.on_parked(event_id, &ParkedAction::Retry { actor, reason })
            .await
            .map(|_| ())
    }

    async fn retry_locked(
        &self,
        conn: &mut MySqlConnection,
        event_id: EventId,
        (actor, reason): (&str, &str),
        s: &EventState,
    ) -> Result<(), StoreError> {
        refuse_unkeyable(event_id, s)?;
        if s.version <= s.last {
            return Err(out_of_order(event_id, s.version, s.last));
        }
        sqlx::query(&format!(
            "UPDATE {} SET status = 'pending', attempts = 0, \
               next_attempt_at = '1000-01-01 00:00:00', park_kind = NULL, \
               parked_at = NULL, blocked = 0, held_since = NULL, claim_token = {NO_TOKEN} \
             WHERE id = ? AND status = 'parked'",
            self.inner.tables.events
        ))
        .bind(s.id)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        // The operator's answer to a gap: this version is the aggregate's next.
        self.raise_last(conn, &s.key, s.version - 1).await?;
        self.audit(conn, (event_id, OperatorAction::Retry, actor, reason, None))
            .await
    }

    pub(super) async fn discard_parked_inner(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        require_reason(reason)?;
        self.on_parked(event_id, &ParkedAction::Discard { actor, reason })
            .await
            .map(|_| ())
    }

    async fn discard_locked(
        &self,
        conn: &mut MySqlConnection,
        event_id: EventId,
        actor: &str,
        reason: &str,
        s: &EventState,
    ) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "UPDATE {} SET status = 'discarded', finished_at = UTC_TIMESTAMP(6), \
               discard_reason = ?, blocked = 0 WHERE id = ? AND status = 'parked'",
            self.inner.tables.events
        ))
        .bind(reason)
        .bind(s.id)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        // Never below what the claims count from (a discarded out-of-order version of an
        // aggregate without state is below its first version, which stays next).
        self.raise_last(conn, &s.key, s.version.max(s.last)).await?;
        self.audit(
            conn,
            (event_id, OperatorAction::Discard, actor, reason, None),
        )
        .await
    }

    pub(super) async fn reissue_parked_inner(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        require_reason(reason)?;
        let copy = self
            .on_parked(event_id, &ParkedAction::Reissue { actor, reason })
            .await?;
        copy.ok_or_else(|| StoreError::new(StoreErrorKind::Other, "re-issue made no copy"))
    }

    async fn reissue_locked(
        &self,
        conn: &mut MySqlConnection,
        event_id: EventId,
        actor: &str,
        reason: &str,
        s: &EventState,
    ) -> Result<EventId, StoreError> {
        refuse_unkeyable(event_id, s)?;
        if s.version <= s.last {
            return Err(out_of_order(event_id, s.version, s.last));
        }
        let t = &self.inner.tables;
        let new_id = EventId::now_v7();
        let original = sqlx::query(&format!(
            "SELECT {ENVELOPE_COLS} FROM {} WHERE id = ?",
            t.events
        ))
        .bind(s.id)
        .fetch_one(&mut *conn)
        .await
        .map_err(db)?;
        // The copy keeps the original's id in a header (the first original's, when the parked
        // event is itself a copy), so inboxes deduplicate the two as one event.
        let headers = copy_headers(&original, event_id)?;
        sqlx::query(&format!(
            "UPDATE {} SET status = 'discarded', finished_at = UTC_TIMESTAMP(6), \
               discard_reason = ?, blocked = 0 WHERE id = ? AND status = 'parked'",
            t.events
        ))
        .bind(reason)
        .bind(s.id)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        sqlx::query(&format!(
            "INSERT INTO {ev} ({ENVELOPE_COLS}, inserted_at) \
             SELECT ?, aggregate_type, aggregate_id, aggregate_version, event_type, \
                    schema_version, content_type, payload, ?, created_at, UTC_TIMESTAMP(6) \
             FROM {ev} WHERE id = ?",
            ev = t.events
        ))
        .bind(new_id.as_uuid())
        .bind(headers)
        .bind(s.id)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        // The copy is the aggregate's next version.
        self.raise_last(conn, &s.key, s.version - 1).await?;
        self.audit(
            conn,
            (
                event_id,
                OperatorAction::Reissue,
                actor,
                reason,
                Some(new_id),
            ),
        )
        .await?;
        Ok(new_id)
    }

    pub(super) async fn release_claims_of_inner(
        &self,
        owner: &str,
        actor: &str,
    ) -> Result<u64, StoreError> {
        if self.inner.settings.claim_mode == ClaimMode::LockedTransaction {
            // A locked claim ends with its relay's connection (or the server's wait_timeout).
            return Ok(0);
        }
        let t = &self.inner.tables;
        let reason = format!("claims of relay {owner} released");
        let mut released = self.release_lease_claims_of(owner, actor, &reason).await?;
        // Leases a relay of the previous version wrote into the state rows (a rolling upgrade).
        // Byte for byte: `utf8mb4_bin` is a PAD SPACE collation, so `lease_owner = 'r '`
        // would match the live leases of relay `r` (a binary string compares every byte).
        let leases: Vec<(Vec<u8>, i64)> = sqlx::query_as(&format!(
            "SELECT aggregate_key, lease_row FROM {} \
             WHERE lease_owner = CAST(? AS BINARY) AND lease_until > UTC_TIMESTAMP(6) \
               AND lease_row IS NOT NULL",
            t.state
        ))
        .bind(owner)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        for (key, row) in &leases {
            let done = tx::retry_lock_conflicts!(
                self.release_one_lease_tx(key, *row, owner, actor, &reason)
                    .await
            )?;
            if done {
                released += 1;
            }
        }
        Ok(released)
    }

    /// The live lease claims of `owner`: its batches' lease rows (by owner), their rows that
    /// still carry the batch's token and wait for the lease to end (no index on the token: a
    /// range of `claim_idx`, filtered; a rare action), each released under its aggregate's
    /// lock; then the batches' lease rows are deleted. Returns the rows released.
    async fn release_lease_claims_of(
        &self,
        owner: &str,
        actor: &str,
        reason: &str,
    ) -> Result<u64, StoreError> {
        let t = &self.inner.tables;
        let tokens: Vec<Uuid> = sqlx::query_scalar(&format!(
            "SELECT token FROM {} WHERE owner = CAST(? AS BINARY)",
            t.lease
        ))
        .bind(owner)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        if tokens.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "SELECT id, aggregate_key, claim_token FROM {} \
             WHERE status = 'pending' AND claim_token IN ({}) \
               AND next_attempt_at > UTC_TIMESTAMP(6) ORDER BY id",
            t.events,
            marks(tokens.len())
        );
        let mut q = sqlx::query_as::<_, (i64, Vec<u8>, Uuid)>(&sql);
        for token in &tokens {
            q = q.bind(token);
        }
        let rows = q.fetch_all(&self.inner.pool).await.map_err(db)?;
        let mut released = 0;
        for (id, key, token) in &rows {
            let done = tx::retry_lock_conflicts!(
                self.release_claimed_row_tx(key, *id, *token, actor, reason)
                    .await
            )?;
            if done {
                released += 1;
            }
        }
        let sql = format!(
            "DELETE FROM {} WHERE token IN ({}) AND owner = CAST(? AS BINARY)",
            t.lease,
            marks(tokens.len())
        );
        let mut q = sqlx::query(&sql);
        for token in &tokens {
            q = q.bind(token);
        }
        q.bind(owner).execute(&self.inner.pool).await.map_err(db)?;
        Ok(released)
    }

    /// Releases the row `id` of the lease claim `token` under its aggregate's lock, if the
    /// claim still holds it and its lease is live; `true` when it did.
    async fn release_claimed_row_tx(
        &self,
        key: &Key,
        id: i64,
        token: Uuid,
        actor: &str,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = begin(&self.inner.pool).await?;
        let done = async {
            let t = &self.inner.tables;
            sqlx::query(&format!(
                "SELECT aggregate_key FROM {} WHERE aggregate_key = ? FOR UPDATE",
                t.state
            ))
            .bind(key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
            // The row waited for its lease: due again now, without the token (so the claim's
            // completion applies nothing to it), and possibly sent (the gone relay may have
            // published it: its next publication counts as a re-publication). Only while it
            // still waits for this claim's lease (its `next_attempt_at` is the lease's end, see
            // `complete::Fence`): a relay of the previous version that took it over wrote a
            // later one, and its lease is not this owner's to end.
            let n = sqlx::query(&format!(
                "UPDATE {} SET next_attempt_at = UTC_TIMESTAMP(6), claim_token = {NO_TOKEN}, \
                   maybe_delivered = 1 \
                 WHERE id = ? AND status = 'pending' AND claim_token = ? \
                   AND next_attempt_at > UTC_TIMESTAMP(6) \
                   AND next_attempt_at = (SELECT l.until FROM {} l WHERE l.token = ?)",
                t.events, t.lease
            ))
            .bind(id)
            .bind(token)
            .bind(token)
            .execute(&mut *tx)
            .await
            .map_err(db)?
            .rows_affected();
            if n == 0 {
                return Ok(false);
            }
            let event: Uuid =
                sqlx::query_scalar(&format!("SELECT event_id FROM {} WHERE id = ?", t.events))
                    .bind(id)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db)?;
            self.audit(
                &mut tx,
                (
                    EventId::from_uuid(event),
                    OperatorAction::ReleaseClaim,
                    actor,
                    reason,
                    None,
                ),
            )
            .await?;
            Ok(true)
        }
        .await;
        finish(tx, done).await
    }

    async fn release_one_lease_tx(
        &self,
        key: &Key,
        row: i64,
        owner: &str,
        actor: &str,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = begin(&self.inner.pool).await?;
        let done = self
            .release_one_lease(&mut tx, key, row, owner, actor, reason)
            .await;
        finish(tx, done).await
    }

    /// Ends one live lease of `owner` under its aggregate's lock; `true` when there was one.
    async fn release_one_lease(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        row: i64,
        owner: &str,
        actor: &str,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let t = &self.inner.tables;
        let live: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT lease_row FROM {} WHERE aggregate_key = ? AND lease_owner = CAST(? AS BINARY) \
               AND lease_until > UTC_TIMESTAMP(6) AND lease_row = ? FOR UPDATE",
            t.state
        ))
        .bind(key)
        .bind(owner)
        .bind(row)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db)?
        .flatten();
        if live.is_none() {
            return Ok(false);
        }
        sqlx::query(&format!(
            "UPDATE {} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
               lease_row = NULL, updated_at = UTC_TIMESTAMP(6) WHERE aggregate_key = ?",
            t.state
        ))
        .bind(key)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        // The row waited for its lease: due again now. The gone relay may have sent it: its
        // next publication is a re-publication (counted in `outbox_republished_total`), as
        // after a lease that expired.
        sqlx::query(&format!(
            "UPDATE {} SET next_attempt_at = UTC_TIMESTAMP(6), maybe_delivered = 1 \
             WHERE id = ? AND status = 'pending'",
            t.events
        ))
        .bind(row)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        let event: Option<Uuid> =
            sqlx::query_scalar(&format!("SELECT event_id FROM {} WHERE id = ?", t.events))
                .bind(row)
                .fetch_optional(&mut *conn)
                .await
                .map_err(db)?;
        if let Some(event) = event {
            self.audit(
                conn,
                (
                    EventId::from_uuid(event),
                    OperatorAction::ReleaseClaim,
                    actor,
                    reason,
                    None,
                ),
            )
            .await?;
        }
        Ok(true)
    }

    pub(super) async fn audit_trail_inner(
        &self,
        event_id: Option<EventId>,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT event_id, action, actor, reason, new_event_id, at FROM {} \
             WHERE ? IS NULL OR event_id = ? ORDER BY id",
            self.inner.tables.audit
        ))
        .bind(event_id.map(|e| e.as_uuid()))
        .bind(event_id.map(|e| e.as_uuid()))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter().map(audit_from_row).collect()
    }
}

fn audit_from_row(row: &MySqlRow) -> Result<AuditEntry, StoreError> {
    let action: String = crate::error::text(row, "action")?;
    Ok(AuditEntry::new(
        EventId::from_uuid(row.try_get("event_id").map_err(db)?),
        OperatorAction::parse(&action).ok_or_else(|| {
            StoreError::new(StoreErrorKind::Schema, format!("unknown action {action}"))
        })?,
        crate::error::text(row, "actor")?,
        crate::error::text(row, "reason")?,
        row.try_get::<Option<Uuid>, _>("new_event_id")
            .map_err(db)?
            .map(EventId::from_uuid),
        utc(row.try_get("at").map_err(db)?),
    ))
}

/// The headers of a re-issued copy: the original's, with the id of the first original.
fn copy_headers(original: &MySqlRow, event_id: EventId) -> Result<String, StoreError> {
    let headers: String = crate::error::text(original, "headers")?;
    let mut map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&headers)
        .map_err(|e| StoreError::new(StoreErrorKind::Schema, format!("stored headers: {e}")))?;
    map.entry(outbox_core::wire::ORIGINAL_EVENT_ID.to_owned())
        .or_insert_with(|| serde_json::Value::String(event_id.to_string()));
    serde_json::to_string(&map)
        .map_err(|e| StoreError::new(StoreErrorKind::Other, format!("headers: {e}")))
}

fn not_parked(event_id: EventId) -> StoreError {
    StoreError::new(
        StoreErrorKind::NotFound,
        format!("event {event_id} is not parked (or does not exist)"),
    )
}

fn versions_waiting(event_id: EventId, s: &EventState) -> StoreError {
    StoreError::new(
        StoreErrorKind::Conflict,
        format!(
            "event {event_id} has version {}, and {} event(s) of its aggregate between version \
             {} and it are waiting to go out first; act on this event after they are \
             delivered (or act on them first)",
            s.version, s.waiting_below, s.last
        ),
    )
    .with_class(ErrorClass::Permanent)
}

/// A stored event whose aggregate names are longer than any store keys (written by other
/// means, or by an earlier version of this crate) can never be published: retrying or
/// re-issuing it (a copy has the same names) is refused; discarding it works.
fn refuse_unkeyable(event_id: EventId, s: &EventState) -> Result<(), StoreError> {
    let max = outbox_core::MAX_AGGREGATE_NAME_BYTES;
    let (type_bytes, id_bytes) = s.name_bytes;
    if type_bytes > max || id_bytes > max {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            format!(
                "event {event_id} has an aggregate_type of {type_bytes} bytes and an \
                 aggregate_id of {id_bytes} bytes; at most {max} bytes each can be published: \
                 discard it and append the event again under shorter names"
            ),
        ));
    }
    Ok(())
}

fn out_of_order(event_id: EventId, version: i64, last: i64) -> StoreError {
    StoreError::new(
        StoreErrorKind::Conflict,
        format!(
            "event {event_id} has version {version}, at or below {last}, the last version \
             published or discarded for its aggregate: sending it now would deliver it after a \
             later version; discard it instead"
        ),
    )
    .with_class(ErrorClass::Permanent)
}

fn require_reason(reason: &str) -> Result<(), StoreError> {
    if reason.trim().is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            "this operator action requires a non-empty reason",
        ));
    }
    Ok(())
}
