//! Operator actions on parked events, and on the claims of a relay that is gone. Each runs
//! under the event's aggregate lock, decides on a snapshot taken after it, commits
//! synchronously and is audited.

use sqlx::{PgConnection, Postgres, Row, Transaction};
use uuid::Uuid;

use outbox_core::{
    AuditEntry, ClaimMode, ErrorClass, EventId, OperatorAction, ParkedEvent, StoreError,
    StoreErrorKind,
};

use super::claim::{abort, finish, BEGIN_CLAIM, SYNC_COMMIT};
use super::rows::parked_from_row;
use super::PostgresOutboxStore;
use crate::error::db;

/// An event's state as read after its aggregate's lock.
struct EventState {
    status: String,
    agg_type: String,
    agg_id: String,
    version: i64,
    key: i64,
    last: i64,
    /// Unfinished rows of the aggregate between `last` and this event's version.
    waiting_below: i64,
}

impl EventState {
    fn read(row: &sqlx::postgres::PgRow) -> Result<Self, StoreError> {
        Ok(Self {
            status: row.try_get("status").map_err(db)?,
            agg_type: row.try_get("aggregate_type").map_err(db)?,
            agg_id: row.try_get("aggregate_id").map_err(db)?,
            version: row.try_get("aggregate_version").map_err(db)?,
            key: row.try_get("k").map_err(db)?,
            last: row.try_get("last").map_err(db)?,
            waiting_below: row.try_get("waiting_below").map_err(db)?,
        })
    }
}

impl PostgresOutboxStore {
    /// A transaction holding the lock of `event_id`'s aggregate, and the event's state read
    /// after it. `NotFound` unless the event exists and is parked.
    async fn lock_parked(
        &self,
        event_id: EventId,
    ) -> Result<(Transaction<'static, Postgres>, EventState), StoreError> {
        let mut tx = self
            .inner
            .pool
            .begin_with(format!("{BEGIN_CLAIM}; {SYNC_COMMIT}"))
            .await
            .map_err(db)?;
        match self.read_locked(&mut tx, event_id).await {
            Ok(state) => Ok((tx, state)),
            Err(e) => abort(tx, e).await,
        }
    }

    async fn read_locked(
        &self,
        tx: &mut PgConnection,
        event_id: EventId,
    ) -> Result<EventState, StoreError> {
        let sql = &self.inner.sql;
        let before = sqlx::query(&sql.event_state)
            .bind(event_id.as_uuid())
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?
            .ok_or_else(|| not_parked(event_id))?;
        let key: i64 = before.try_get("k").map_err(db)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(self.lock_key(key))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        let row = sqlx::query(&sql.event_state)
            .bind(event_id.as_uuid())
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        let state = EventState::read(&row)?;
        if state.status != "parked" {
            return Err(not_parked(event_id));
        }
        if state.waiting_below > 0 {
            // Lower versions arrived after this event was parked (a gap that is filling):
            // accepting or dropping this version now would park them as out of order.
            return Err(versions_waiting(event_id, &state));
        }
        Ok(state)
    }

    async fn audit(
        &self,
        conn: &mut PgConnection,
        entry: (EventId, OperatorAction, &str, &str, Option<EventId>),
    ) -> Result<(), StoreError> {
        let (event_id, action, actor, reason, new_id) = entry;
        sqlx::query(&self.inner.sql.audit)
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

    async fn notify_after(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        if let Some(ch) = &self.inner.settings.notify_channel {
            sqlx::query("SELECT pg_notify($1, '')::text")
                .bind(ch)
                .execute(conn)
                .await
                .map_err(db)?;
        }
        Ok(())
    }

    pub(super) async fn parked_event_inner(
        &self,
        event_id: EventId,
    ) -> Result<ParkedEvent, StoreError> {
        let row = sqlx::query(&self.inner.sql.parked_event)
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
        let rows = sqlx::query(&self.inner.sql.list_parked)
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
        let (mut tx, s) = self.lock_parked(event_id).await?;
        let done = self
            .retry_locked(&mut tx, event_id, (actor, reason), &s)
            .await;
        finish(tx, done).await
    }

    async fn retry_locked(
        &self,
        tx: &mut PgConnection,
        event_id: EventId,
        (actor, reason): (&str, &str),
        s: &EventState,
    ) -> Result<(), StoreError> {
        refuse_unkeyable(event_id, s)?;
        if s.version <= s.last {
            return Err(out_of_order(event_id, s.version, s.last));
        }
        sqlx::query(&self.inner.sql.retry_parked)
            .bind(event_id.as_uuid())
            .bind(s.key)
            .bind(&s.agg_type)
            .bind(&s.agg_id)
            .bind(s.version - 1)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        self.audit(tx, (event_id, OperatorAction::Retry, actor, reason, None))
            .await?;
        self.notify_after(tx).await
    }

    pub(super) async fn discard_parked_inner(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        require_reason(reason)?;
        let (mut tx, s) = self.lock_parked(event_id).await?;
        let done = self
            .discard_locked(&mut tx, event_id, actor, reason, &s)
            .await;
        finish(tx, done).await
    }

    async fn discard_locked(
        &self,
        tx: &mut PgConnection,
        event_id: EventId,
        actor: &str,
        reason: &str,
        s: &EventState,
    ) -> Result<(), StoreError> {
        sqlx::query(&self.inner.sql.discard_parked)
            .bind(event_id.as_uuid())
            .bind(s.key)
            .bind(&s.agg_type)
            .bind(&s.agg_id)
            // Never below what the claims count from: a discarded out-of-order version of an
            // aggregate without state is below its first version (`unknown_last`), which must
            // stay next.
            .bind(s.version.max(s.last))
            .bind(reason)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        self.audit(tx, (event_id, OperatorAction::Discard, actor, reason, None))
            .await?;
        self.notify_after(tx).await
    }

    pub(super) async fn reissue_parked_inner(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        require_reason(reason)?;
        let (mut tx, s) = self.lock_parked(event_id).await?;
        let done = self
            .reissue_locked(&mut tx, event_id, actor, reason, &s)
            .await;
        finish(tx, done).await
    }

    async fn reissue_locked(
        &self,
        tx: &mut PgConnection,
        event_id: EventId,
        actor: &str,
        reason: &str,
        s: &EventState,
    ) -> Result<EventId, StoreError> {
        refuse_unkeyable(event_id, s)?;
        if s.version <= s.last {
            return Err(out_of_order(event_id, s.version, s.last));
        }
        let new_id = EventId::now_v7();
        sqlx::query(&self.inner.sql.reissue_parked)
            .bind(event_id.as_uuid())
            .bind(s.key)
            .bind(&s.agg_type)
            .bind(&s.agg_id)
            .bind(s.version - 1)
            .bind(reason)
            .bind(new_id.as_uuid())
            .bind(outbox_core::wire::ORIGINAL_EVENT_ID)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        self.audit(
            tx,
            (
                event_id,
                OperatorAction::Reissue,
                actor,
                reason,
                Some(new_id),
            ),
        )
        .await?;
        self.notify_after(tx).await?;
        Ok(new_id)
    }

    pub(super) async fn release_claims_of_inner(
        &self,
        owner: &str,
        actor: &str,
    ) -> Result<u64, StoreError> {
        if self.inner.settings.claim_mode == ClaimMode::LockedTransaction {
            // A locked claim ends with its relay's connection (or idle_in_transaction timeout).
            return Ok(0);
        }
        let sql = &self.inner.sql;
        let leases = sqlx::query(&sql.owner_leases)
            .bind(owner)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db)?;
        let reason = format!("claims of relay {owner} released");
        let mut released = 0;
        // One release per aggregate (a lease's run lists several rows of it).
        let mut seen = std::collections::HashSet::new();
        for lease in &leases {
            let key: i64 = lease.try_get("k").map_err(db)?;
            let agg_type: String = lease.try_get("aggregate_type").map_err(db)?;
            let agg_id: String = lease.try_get("aggregate_id").map_err(db)?;
            if !seen.insert((key, agg_type.clone(), agg_id.clone())) {
                continue;
            }
            let mut tx = self
                .inner
                .pool
                .begin_with(format!("{BEGIN_CLAIM}; {SYNC_COMMIT}"))
                .await
                .map_err(db)?;
            let done = self
                .release_one_lease(&mut tx, (key, &agg_type, &agg_id), owner, actor, &reason)
                .await;
            if finish(tx, done).await? {
                released += 1;
            }
        }
        Ok(released)
    }

    /// Ends the live lease of `owner` on one aggregate (key, type, id) under the aggregate's
    /// lock; `true` when there was one. Every row of its run is marked possibly sent; the
    /// release is audited once, under the head's event.
    async fn release_one_lease(
        &self,
        tx: &mut PgConnection,
        (key, agg_type, agg_id): (i64, &str, &str),
        owner: &str,
        actor: &str,
        reason: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(self.lock_key(key))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        // The gone relay may have sent any row of the run: each one's next publication is a
        // re-publication (counted in `outbox_republished_total`), as after a lease that
        // expired. The statement marks them and returns their event ids.
        let done = sqlx::query(&self.inner.sql.release_owner_lease)
            .bind(key)
            .bind(agg_type)
            .bind(agg_id)
            .bind(owner)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        if done.try_get::<i64, _>("released").map_err(db)? == 0 {
            return Ok(false);
        }
        // One audit entry per released claim, as without runs: the head's event (first).
        let events: Vec<Uuid> = done.try_get("events").map_err(db)?;
        if let Some(head) = events.first() {
            let id = EventId::from_uuid(*head);
            self.audit(tx, (id, OperatorAction::ReleaseClaim, actor, reason, None))
                .await?;
        }
        self.notify_after(tx).await?;
        Ok(true)
    }

    pub(super) async fn audit_trail_inner(
        &self,
        event_id: Option<EventId>,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = sqlx::query(&self.inner.sql.audit_trail)
            .bind(event_id.map(|e| e.as_uuid()))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db)?;
        rows.iter()
            .map(|row| {
                let action: String = row.try_get("action").map_err(db)?;
                Ok(AuditEntry::new(
                    EventId::from_uuid(row.try_get("event_id").map_err(db)?),
                    OperatorAction::parse(&action).ok_or_else(|| {
                        StoreError::new(StoreErrorKind::Schema, format!("unknown action {action}"))
                    })?,
                    row.try_get::<String, _>("actor").map_err(db)?,
                    row.try_get::<String, _>("reason").map_err(db)?,
                    row.try_get::<Option<Uuid>, _>("new_event_id")
                        .map_err(db)?
                        .map(EventId::from_uuid),
                    row.try_get("at").map_err(db)?,
                ))
            })
            .collect()
    }
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

/// A stored event whose aggregate names are longer than a store can key (written by other
/// means, or before the bound) can never be published: retrying or re-issuing it (a copy has
/// the same names) is refused; discarding it works.
fn refuse_unkeyable(event_id: EventId, s: &EventState) -> Result<(), StoreError> {
    let max = outbox_core::MAX_AGGREGATE_NAME_BYTES;
    if s.agg_type.len() > max || s.agg_id.len() > max {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            format!(
                "event {event_id} has an aggregate_type of {} bytes and an aggregate_id of {} \
                 bytes; at most {max} bytes each can be published: discard it and append the \
                 event again under shorter names",
                s.agg_type.len(),
                s.agg_id.len()
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
