//! Append (the application's role): validation, the backpressure hook, multi-row INSERTs in
//! the caller's transaction.

use chrono::Datelike;
use sqlx::{Executor, MySql};

use outbox_core::{Envelope, StoreError, StoreErrorKind};

use super::rows::{headers_json, ENVELOPE_COLS};
use super::MySqlOutboxStore;
use crate::error::db;

/// Longest event type or content type the TEXT columns hold (bytes), for a raised
/// `max_name_len`. The aggregate type and id are bounded far lower, by
/// [`outbox_core::MAX_AGGREGATE_NAME_BYTES`], as in every store.
pub(crate) const MAX_TEXT_BYTES: usize = 65_535;

/// Rows per INSERT statement (10 placeholders each, far below the protocol's 65,535).
const ROWS_PER_STATEMENT: usize = 500;
/// Payload and header bytes per INSERT statement, well below the default `max_allowed_packet`
/// (16 MiB on MariaDB, 64 MiB on MySQL 8).
const BYTES_PER_STATEMENT: usize = 4 * 1024 * 1024;

impl MySqlOutboxStore {
    /// Appends one event through any executor (`&mut *tx` of your `sqlx::Transaction`, a
    /// `&mut MySqlConnection`, `&MySqlPool`).
    pub async fn append<'e, E>(&self, executor: E, event: &Envelope) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = MySql>,
    {
        self.append_many(executor, std::slice::from_ref(event))
            .await
    }

    /// Appends many events in one multi-row INSERT (one round trip) through any executor.
    ///
    /// Validates every envelope first (a `Validation` error writes nothing): the envelope
    /// limits, with the aggregate type and id at most [`outbox_core::MAX_AGGREGATE_NAME_BYTES`]
    /// (1,024) bytes each whatever `max_name_len` allows; MySQL's DATETIME also refuses a
    /// `created_at` before the year 1000, and its TEXT columns an event or content type over
    /// 65,535 bytes. Then it asks the [`crate::AppendGuard`] (a `Backpressure` error writes
    /// nothing). A duplicate event id is a `Constraint` error; MySQL rolls back that statement
    /// only, so the caller's transaction stays usable. One statement holds up to 500 events and
    /// 4 MiB (below the default `max_allowed_packet`); a larger batch is a `Validation` error
    /// here: [`append_many_in`](Self::append_many_in) splits it inside a savepoint.
    ///
    /// Append takes no lock and never waits for a relay. Append an aggregate's events in
    /// version order, each version once, under the aggregate's own row lock (or a conditional
    /// update of its version) in the business transaction: then version N+1 never commits
    /// before N. If it does anyway, the relay holds N+1 until N arrives (and parks it as a
    /// version gap after the store's gap timeout), and parks a version that arrives after a
    /// higher one was published as out of order; it never publishes out of order.
    ///
    /// A relay of this process is woken only through [`Self::commit_and_wake`] (or
    /// [`Self::wake_relays`] after your commit); others poll.
    pub async fn append_many<'e, E>(
        &self,
        executor: E,
        events: &[Envelope],
    ) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = MySql>,
    {
        if events.is_empty() {
            return Ok(());
        }
        let headers = self.validate(events)?;
        if chunks(events, &headers).len() > 1 {
            return Err(StoreError::new(
                StoreErrorKind::Validation,
                format!(
                    "{} events do not fit one statement ({ROWS_PER_STATEMENT} events, \
                     {BYTES_PER_STATEMENT} bytes): append them with append_many_in, which \
                     splits a batch inside a savepoint of your transaction",
                    events.len()
                ),
            ));
        }
        self.insert(executor, events, &headers).await
    }

    /// Appends a batch of any size on `conn` (your transaction's connection: `&mut *tx`): one
    /// INSERT per 500 events / 4 MiB, inside a savepoint when it takes more than one, so the
    /// batch is all or nothing. The path of `AppendStore::append`.
    pub async fn append_many_in(
        &self,
        conn: &mut sqlx::MySqlConnection,
        events: &[Envelope],
    ) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let headers = self.validate(events)?;
        self.append_validated(conn, events, &headers).await
    }

    async fn append_validated(
        &self,
        conn: &mut sqlx::MySqlConnection,
        events: &[Envelope],
        headers: &[String],
    ) -> Result<(), StoreError> {
        let chunks = chunks(events, headers);
        if chunks.len() == 1 {
            return self.insert(&mut *conn, events, headers).await;
        }
        // Several statements: a savepoint in the caller's transaction, or a transaction.
        let mut tx = sqlx::Connection::begin(conn).await.map_err(db)?;
        for (from, to) in chunks {
            self.insert(&mut *tx, &events[from..to], &headers[from..to])
                .await?;
        }
        tx.commit().await.map_err(db)
    }

    /// Validates `events` and asks the append guard; returns their stored headers.
    fn validate(&self, events: &[Envelope]) -> Result<Vec<String>, StoreError> {
        let s = &self.inner.settings;
        let mut headers = Vec::with_capacity(events.len());
        for e in events {
            e.validate(&s.limits)?;
            if e.created_at.year() < 1000 {
                return Err(StoreError::new(
                    StoreErrorKind::Validation,
                    format!(
                        "created_at {} is before the year 1000, which MySQL's DATETIME cannot \
                         hold",
                        e.created_at
                    ),
                ));
            }
            for (field, value) in [
                ("event_type", &e.event_type),
                ("content_type", &e.payload.content_type),
            ] {
                if value.len() > MAX_TEXT_BYTES {
                    return Err(StoreError::new(
                        StoreErrorKind::Validation,
                        format!(
                            "{field} is {} bytes; MySQL's TEXT column holds at most \
                             {MAX_TEXT_BYTES}",
                            value.len()
                        ),
                    ));
                }
            }
            headers.push(headers_json(e)?);
        }
        if let Some(guard) = &s.append_guard {
            guard.check(events)?;
        }
        Ok(headers)
    }

    async fn insert<'e, E>(
        &self,
        executor: E,
        events: &[Envelope],
        headers: &[String],
    ) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = MySql>,
    {
        let values = vec!["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6))"; events.len()];
        let sql = format!(
            "INSERT INTO {} ({ENVELOPE_COLS}, inserted_at) VALUES {}",
            self.inner.tables.events,
            values.join(", ")
        );
        let mut q = sqlx::query(&sql);
        for (e, h) in events.iter().zip(headers) {
            q = q
                .bind(e.event_id.as_uuid())
                .bind(&e.aggregate_type)
                .bind(&e.aggregate_id)
                .bind(e.aggregate_version)
                .bind(&e.event_type)
                .bind(e.schema_version)
                .bind(&e.payload.content_type)
                .bind(&e.payload.bytes)
                .bind(h)
                .bind(e.created_at.naive_utc());
        }
        let n = q.execute(executor).await.map_err(db)?.rows_affected();
        if n as usize != events.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("appended {n} of {} events", events.len()),
            ));
        }
        Ok(())
    }
}

/// `[from, to)` ranges of `events` for one INSERT each.
fn chunks(events: &[Envelope], headers: &[String]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let (mut from, mut bytes) = (0, 0);
    for (i, (e, h)) in events.iter().zip(headers).enumerate() {
        let size = e.payload.bytes.len() + h.len() + e.aggregate_id.len() + 256;
        if i > from && (i - from >= ROWS_PER_STATEMENT || bytes + size > BYTES_PER_STATEMENT) {
            out.push((from, i));
            from = i;
            bytes = 0;
        }
        bytes += size;
    }
    out.push((from, events.len()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(payload: usize) -> Envelope {
        Envelope::builder("order", "o-1", 1, "t")
            .payload(outbox_core::Payload::new(
                "application/octet-stream",
                vec![0u8; payload],
            ))
            .limits(outbox_core::EnvelopeLimits::unlimited())
            .build()
            .unwrap()
    }

    #[test]
    fn batches_split_by_rows_and_bytes() {
        let small: Vec<Envelope> = (0..1200).map(|_| event(10)).collect();
        let h = vec!["{}".to_owned(); small.len()];
        assert_eq!(
            chunks(&small, &h),
            vec![(0, 500), (500, 1000), (1000, 1200)]
        );
        let big: Vec<Envelope> = (0..10).map(|_| event(900 * 1024)).collect();
        let h = vec!["{}".to_owned(); big.len()];
        let c = chunks(&big, &h);
        assert_eq!(c.first(), Some(&(0, 4)));
        assert_eq!(c.last().map(|r| r.1), Some(10));
        assert!(c.windows(2).all(|w| w[0].1 == w[1].0));
        // One oversized event still goes alone.
        let huge = vec![event(5 * 1024 * 1024)];
        assert_eq!(chunks(&huge, &["{}".to_owned()]), vec![(0, 1)]);
    }
}
