//! Append: validation, the backpressure hook, one `INSERT .. SELECT FROM UNNEST`.

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
        let (k1, k2) = super::wake_gate::gate_keys(self.inner.seed);
        let gate = s.wake_gate.then_some((k1, k2));
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
            .fetch_one(executor)
            .await
            .map_err(db)?;
        let n: i64 = row.try_get("n").map_err(db)?;
        let notified: i64 = row.try_get("notified").map_err(db)?;
        self.inner
            .notifies
            .fetch_add(notified as u64, std::sync::atomic::Ordering::Relaxed);
        if n as usize != events.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("appended {n} of {} events", events.len()),
            ));
        }
        Ok(())
    }
}
