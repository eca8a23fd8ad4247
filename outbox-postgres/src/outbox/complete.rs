//! Completions and releases: outcomes applied under the claimed aggregates' locks.

use std::collections::{HashMap, HashSet};

use sqlx::{Postgres, Row};
use uuid::Uuid;

use outbox_core::{
    AckMetadata, ClaimHandle, ClaimMode, CompletionReport, Outcome, ParkKind, StoreError,
    StoreErrorKind,
};

use super::claim::{finish, ClaimedRow, ASYNC_COMMIT, BEGIN_CLAIM, SYNC_COMMIT};
use super::PostgresOutboxStore;
use crate::error::db;

/// Longest delay a completion records.
const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

impl PostgresOutboxStore {
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
                // The aggregate locks were taken by the claim in this very transaction.
                let applied = OutcomeArrays::new(outcomes, &held.rows)
                    .bind(sqlx::query(&self.inner.sql.complete_locked))
                    .fetch_one(&mut *held.tx)
                    .await
                    .map_err(|e| lost_claim(db(e)))
                    .and_then(|row| row.try_get::<Vec<i64>, _>("applied").map_err(db));
                let applied = finish(held.tx, applied).await.map_err(lost_claim)?;
                Ok(report(outcomes, &held.rows, &applied))
            }
            _ => {
                let rows = self.lease_rows(claim.token).await?;
                let begin = if self.inner.settings.synchronous_completion {
                    format!("{BEGIN_CLAIM}; {SYNC_COMMIT}")
                } else {
                    format!("{BEGIN_CLAIM}; {ASYNC_COMMIT}")
                };
                let mut tx = self.inner.pool.begin_with(begin).await.map_err(db)?;
                // Serialize with claims and operator actions on the same aggregates, whatever
                // the outcomes: a claim decides after it holds these locks, so it sees this
                // completion whole or not at all.
                let applied = async {
                    self.lock_rows(&mut tx, &rows).await?;
                    OutcomeArrays::new(outcomes, &rows)
                        .bind(sqlx::query(&self.inner.sql.complete_lease))
                        .bind(claim.token)
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(db)?
                        .try_get::<Vec<i64>, _>("applied")
                        .map_err(db)
                }
                .await;
                let applied = finish(tx, applied).await?;
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
                    if let Err(e) = held.tx.rollback().await {
                        // The connection is gone, and with it the locks.
                        tracing::warn!(error = %e, "rollback of a released claim failed");
                    }
                }
                Ok(())
            }
            _ => {
                let rows = self.lease_rows(claim.token).await?;
                if rows.is_empty() {
                    return Ok(());
                }
                let keys: Vec<i64> = rows.iter().map(|r| r.key).collect();
                let mut tx = self
                    .inner
                    .pool
                    .begin_with(format!("{BEGIN_CLAIM}; {SYNC_COMMIT}"))
                    .await
                    .map_err(db)?;
                let released = async {
                    self.lock_rows(&mut tx, &rows).await?;
                    sqlx::query(&self.inner.sql.release_lease)
                        .bind(claim.token)
                        .bind(&keys)
                        .execute(&mut *tx)
                        .await
                        .map_err(db)
                }
                .await;
                finish(tx, released).await.map(|_| ())
            }
        }
    }

    /// Takes the advisory locks of the aggregates of `rows` (blocking, in key order).
    pub(super) async fn lock_rows(
        &self,
        conn: &mut sqlx::PgConnection,
        rows: &[ClaimedRow],
    ) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        let keys: Vec<i64> = rows.iter().map(|r| self.lock_key(r.key)).collect();
        sqlx::query(&self.inner.sql.lock_keys)
            .bind(&keys)
            .execute(conn)
            .await
            .map_err(db)?;
        Ok(())
    }

    /// The rows of a lease claim: from memory (claimed here), else from the database.
    pub(super) async fn lease_rows(&self, token: Uuid) -> Result<Vec<ClaimedRow>, StoreError> {
        let known = self.inner.leased.lock().expect("poisoned").remove(&token);
        match known {
            Some((rows, _)) => Ok(rows),
            None => {
                let rows = sqlx::query(&self.inner.sql.lease_rows)
                    .bind(token)
                    .fetch_all(&self.inner.pool)
                    .await
                    .map_err(db)?;
                rows.iter()
                    .map(|r| {
                        Ok(ClaimedRow {
                            id: r.try_get("id")?,
                            event: r.try_get("event_id")?,
                            key: r.try_get("k")?,
                            agg_type: r.try_get("aggregate_type")?,
                            agg_id: r.try_get("aggregate_id")?,
                            version: r.try_get("aggregate_version")?,
                            // Not read by the completion (it orders a run by version).
                            run_position: 0,
                        })
                    })
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(db)
            }
        }
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

pub(super) fn lost_claim(e: StoreError) -> StoreError {
    if e.kind == StoreErrorKind::Connection {
        StoreError::new(
            StoreErrorKind::LeaseLost,
            format!("the locked claim transaction was lost: {}", e.message),
        )
        .with_source(e)
    } else {
        e
    }
}

/// One entry per claimed row, for `UNNEST`: its outcome, or `release` when it has none.
struct OutcomeArrays {
    ids: Vec<i64>,
    keys: Vec<i64>,
    types: Vec<String>,
    agg_ids: Vec<String>,
    versions: Vec<i64>,
    kinds: Vec<&'static str>,
    destinations: Vec<Option<String>>,
    parts: Vec<Option<i32>>,
    offsets: Vec<Option<i64>>,
    delays: Vec<Option<i64>>,
    eclass: Vec<Option<&'static str>>,
    ekind: Vec<Option<String>>,
    emsg: Vec<Option<String>>,
    pkind: Vec<Option<&'static str>>,
    uncertain: Vec<bool>,
    transports: Vec<Option<&'static str>>,
    routes: Vec<Option<String>>,
    duplicates: Vec<Option<bool>>,
}

impl OutcomeArrays {
    /// Outcomes of events that are not rows of the claim are left out (they are refused).
    fn new(outcomes: &[Outcome], claimed: &[ClaimedRow]) -> Self {
        // The relay hands back one outcome per claimed row, in claim order: matched by
        // position (each checked against its row's event id). Any other shape (a subset, another
        // order, outcomes of other events) is matched by event id.
        let in_order = outcomes.len() == claimed.len()
            && outcomes
                .iter()
                .zip(claimed)
                .all(|(o, row)| o.event_id().as_uuid() == row.event);
        let by_event: HashMap<Uuid, &Outcome> = if in_order {
            HashMap::new()
        } else {
            let mut by_event = HashMap::with_capacity(outcomes.len());
            for o in outcomes {
                by_event.entry(o.event_id().as_uuid()).or_insert(o);
            }
            by_event
        };
        let outcome_of = |i: usize, row: &ClaimedRow| {
            if in_order {
                outcomes.get(i)
            } else {
                by_event.get(&row.event).copied()
            }
        };
        let n = claimed.len();
        let mut a = Self {
            ids: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
            types: Vec::with_capacity(n),
            agg_ids: Vec::with_capacity(n),
            versions: Vec::with_capacity(n),
            kinds: Vec::with_capacity(n),
            destinations: Vec::with_capacity(n),
            parts: Vec::with_capacity(n),
            offsets: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            eclass: Vec::with_capacity(n),
            ekind: Vec::with_capacity(n),
            emsg: Vec::with_capacity(n),
            pkind: Vec::with_capacity(n),
            uncertain: Vec::with_capacity(n),
            transports: Vec::with_capacity(n),
            routes: Vec::with_capacity(n),
            duplicates: Vec::with_capacity(n),
        };
        for (i, row) in claimed.iter().enumerate() {
            a.ids.push(row.id);
            a.keys.push(row.key);
            a.types.push(row.agg_type.clone());
            a.agg_ids.push(row.agg_id.clone());
            a.versions.push(row.version);
            let (kind, ack, delay, err, park) = match outcome_of(i, row) {
                None => ("release", None, None, None, None),
                Some(Outcome::Published { ack, .. }) => ("published", Some(ack), None, None, None),
                Some(Outcome::Retry { delay, error, .. }) => {
                    ("retry", None, Some(*delay), Some(error), None)
                }
                Some(Outcome::Defer { delay, error, .. }) => {
                    ("defer", None, Some(*delay), Some(error), None)
                }
                Some(Outcome::Park { reason, .. }) => {
                    ("park", None, None, Some(&reason.error), Some(reason.kind))
                }
            };
            a.kinds.push(kind);
            let position = ack.and_then(AckMetadata::position);
            a.transports.push(ack.map(|a| a.transport().as_str()));
            a.destinations.push(ack.map(|a| a.destination().to_owned()));
            a.parts.push(position.and_then(|p| p.partition));
            a.offsets.push(position.map(|p| p.offset));
            a.routes
                .push(ack.and_then(|a| a.route().map(str::to_owned)));
            a.duplicates.push(ack.and_then(AckMetadata::duplicate));
            // A delay beyond a year is a policy bug; capped so the timestamp cannot overflow.
            a.delays
                .push(delay.map(|d| super::claim::micros(d.min(MAX_DELAY))));
            a.eclass.push(err.map(|e| e.class.as_str()));
            a.ekind.push(err.map(|e| e.kind.clone()));
            a.emsg.push(err.map(|e| e.message.clone()));
            a.pkind.push(park.map(ParkKind::as_str));
            a.uncertain
                .push(err.is_some_and(|e| e.delivery_uncertain()));
        }
        a
    }

    fn bind<'q>(self, q: PgQuery<'q>) -> PgQuery<'q> {
        q.bind(self.ids)
            .bind(self.keys)
            .bind(self.types)
            .bind(self.agg_ids)
            .bind(self.versions)
            .bind(self.kinds)
            .bind(self.destinations)
            .bind(self.parts)
            .bind(self.offsets)
            .bind(self.delays)
            .bind(self.eclass)
            .bind(self.ekind)
            .bind(self.emsg)
            .bind(self.pkind)
            .bind(self.uncertain)
            .bind(self.transports)
            .bind(self.routes)
            .bind(self.duplicates)
    }
}

#[cfg(test)]
mod tests {
    use outbox_core::{ErrorClass, EventId, LastError};

    use super::*;

    fn row(id: i64) -> ClaimedRow {
        ClaimedRow {
            id,
            event: Uuid::now_v7(),
            key: id * 10,
            agg_type: "order".to_owned(),
            agg_id: format!("o-{id}"),
            version: 1,
            run_position: 0,
        }
    }

    fn published(row: &ClaimedRow) -> Outcome {
        Outcome::Published {
            event_id: EventId::from_uuid(row.event),
            ack: AckMetadata::kafka("t", 0, row.id * 100),
        }
    }

    fn retry(row: &ClaimedRow) -> Outcome {
        Outcome::Retry {
            event_id: EventId::from_uuid(row.event),
            delay: std::time::Duration::from_millis(5),
            error: LastError {
                class: ErrorClass::Transient,
                kind: "timeout".to_owned(),
                message: "slow".to_owned(),
            },
        }
    }

    /// (row id, kind, ack offset) per claimed row, in claim order.
    fn mapped(outcomes: &[Outcome], rows: &[ClaimedRow]) -> Vec<(i64, &'static str, Option<i64>)> {
        let a = OutcomeArrays::new(outcomes, rows);
        a.ids
            .iter()
            .zip(&a.kinds)
            .zip(&a.offsets)
            .map(|((id, kind), off)| (*id, *kind, *off))
            .collect()
    }

    /// A connection lost under a locked claim means the claim is gone (its locks went with
    /// the session); any other failure keeps its kind.
    #[test]
    fn a_lost_connection_under_a_locked_claim_is_a_lost_lease() {
        let e = lost_claim(StoreError::new(StoreErrorKind::Connection, "reset by peer"));
        assert_eq!(e.kind, StoreErrorKind::LeaseLost);
        assert!(e.message.contains("reset by peer"), "{}", e.message);
        let e = lost_claim(StoreError::new(StoreErrorKind::Conflict, "serialization"));
        assert_eq!(
            (e.kind, e.message.as_str()),
            (StoreErrorKind::Conflict, "serialization")
        );
    }

    /// A retry delay beyond a year (a policy bug) is recorded as one year, so the retry time
    /// cannot overflow; shorter delays are recorded as they are.
    #[test]
    fn retry_delays_are_capped_at_one_year() {
        let rows: Vec<ClaimedRow> = (1..=3).map(row).collect();
        let with_delay = |row: &ClaimedRow, delay: std::time::Duration| match retry(row) {
            Outcome::Retry {
                event_id, error, ..
            } => Outcome::Retry {
                event_id,
                delay,
                error,
            },
            _ => unreachable!(),
        };
        let year = std::time::Duration::from_secs(365 * 24 * 3600);
        let outcomes = vec![
            with_delay(&rows[0], year * 10),
            with_delay(&rows[1], year - std::time::Duration::from_secs(1)),
            published(&rows[2]),
        ];
        let a = OutcomeArrays::new(&outcomes, &rows);
        assert_eq!(
            a.delays,
            vec![Some(31_536_000_000_000), Some(31_535_999_000_000), None]
        );
    }

    #[test]
    fn outcomes_reach_their_rows_in_order_shuffled_or_partial() {
        let rows: Vec<ClaimedRow> = (1..=4).map(row).collect();
        let in_order = vec![
            published(&rows[0]),
            retry(&rows[1]),
            published(&rows[2]),
            published(&rows[3]),
        ];
        let expected = vec![
            (1, "published", Some(100)),
            (2, "retry", None),
            (3, "published", Some(300)),
            (4, "published", Some(400)),
        ];
        assert_eq!(mapped(&in_order, &rows), expected);

        let mut shuffled = in_order.clone();
        shuffled.reverse();
        assert_eq!(mapped(&shuffled, &rows), expected, "matched by event id");

        // Same length, one outcome of an event that is not in the claim: that row gets no
        // outcome (released), the others keep theirs.
        let stranger = row(9);
        let mut foreign = in_order.clone();
        foreign[1] = published(&stranger);
        assert_eq!(
            mapped(&foreign, &rows),
            vec![
                (1, "published", Some(100)),
                (2, "release", None),
                (3, "published", Some(300)),
                (4, "published", Some(400)),
            ]
        );

        // A subset: the rows without an outcome are released.
        let subset = vec![published(&rows[3]), published(&rows[0])];
        assert_eq!(
            mapped(&subset, &rows),
            vec![
                (1, "published", Some(100)),
                (2, "release", None),
                (3, "release", None),
                (4, "published", Some(400)),
            ]
        );
    }
}
