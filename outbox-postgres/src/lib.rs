//! # outbox-postgres
//!
//! The transactional outbox and the consumer inbox on PostgreSQL (sqlx 0.8):
//! [`PostgresOutboxStore`] implements [`outbox_core::OutboxStore`] (every store role) and
//! [`outbox_core::ReportingStore`], and [`PostgresInboxStore`]
//! implements [`outbox_core::InboxStore`].
//!
//! ## Capabilities
//!
//! | Capability | Support |
//! |---|---|
//! | Append in the caller's transaction | yes: `AppendStore::append(&mut *tx, ..)` (`Tx = PgConnection`) or the inherent [`PostgresOutboxStore::append`] / [`PostgresOutboxStore::append_many`], generic over any sqlx executor |
//! | Batch append | one statement, one round trip (`INSERT .. SELECT FROM UNNEST(arrays)`) |
//! | Validation at append | envelope limits, before anything is written; aggregate type and id at most [`outbox_core::MAX_AGGREGATE_NAME_BYTES`] (1,024 bytes) each whatever the name limit, so their state row can be indexed |
//! | Backpressure hook | [`AppendGuard`] (thresholds are the caller's) |
//! | Claim: locked transaction | `ClaimMode::LockedTransaction`: aggregate advisory locks taken with `pg_try_advisory_xact_lock` (busy aggregates are skipped), held by the claim's transaction until `complete`/`release`; every other writer of an aggregate's state takes its lock first |
//! | Claim: lease with fencing | `ClaimMode::Lease { duration }` (at most an hour): owner, unique token, expiry on the database clock, in the aggregate's state row (`<table>_aggregate`); `complete` applies only where the token matches, the rest is reported as `superseded_events`; `lease_remaining` tells the relay its deadline; `release_claims_of` ends the leases of a relay that is gone |
//! | Relay registry | `RelayRegistry` in `<table>_relays` (migration 9): register, heartbeat, deregister on the database clock; `live_claims_of` counts what `release_claims_of` would end, and a released row is marked possibly sent (its next publication counts as a re-publication) |
//! | Lease vs. delivery timeout | rejected by `build()` with [`PostgresOutboxStoreBuilder::publisher_delivery_timeout`], and always by `outbox_core::Relay::new` (locked mode: `locked_max_hold` against one publication, two with prefetch) |
//! | Per-aggregate order, several relays | yes: only the head at `last_version + 1`, the last published version kept per aggregate; gaps held then parked, out-of-order versions parked; see below |
//! | Run claims (`ClaimRequest::run`) | yes, both claim modes (migration 11): after a head, its aggregate's next consecutive versions (each the only unfinished row of its version, pending, due; ended by a gap, a duplicate, a parked or a not-due row), counted against `limit` after the heads, adjacent in version order; the lease records the run's last version (`lease_upto`), so fencing, re-send marking, `stats` (in flight), `release` and `release_claims_of` cover whole runs; `complete` applies a published prefix (a publication whose predecessor is not published in the same completion nor the last version is refused as superseded), advances the last version to its end and leaves the rest of the run as it was, its first row the head again |
//! | Rows committing out of id order | never skipped (no high-water mark) |
//! | Durability | lease claims and operator actions commit with `synchronous_commit = on` whatever the server default; completions asynchronously by default (see below) |
//! | Wake-up | `NOTIFY` from appends while a relay is idle (the wake-up gate, [`OutboxSettings::wake_gate`]), [`PostgresOutboxStore::spawn_listener`] for `outbox_core::driver::run`; needs server sessions (see [Connections](#connections)): behind a pooler in transaction mode the gate turns itself off with a warning and the relay polls |
//! | Parking, retry/discard/re-issue, audit | yes, `<table>_audit` |
//! | Cleanup | bounded batches (one transaction each), optional `<table>_archive` |
//! | Stats | backlog, in flight, blocked behind parked events, gap-held, parked, version gaps held; oldest claimable, blocked and parked ages from the insertion time (`inserted_at`, the database clock); table/index size, dead tuples, autovacuum age, queued rows, conditional-update conflicts in `extra` |
//! | Operator reads | [`outbox_core::ReportingStore`] (held to the reporting conformance suite): publish latency percentiles and flow over a window (a window with more than [`OutboxSettings::latency_sample`] finished events estimated over its latest publications, and labelled so), published events by aggregate/type/time for replay, counts per interval and event type for reconciliation, recorded topic facts ([`PostgresOutboxStore::publish_latency`] and neighbours) |
//! | Conflict counter | [`PostgresOutboxStore::record_conflict`]: the application counts updates its version check refused; exported by the relay daemon |
//! | Error mapping | SQLSTATE / sqlx variants to transient or permanent ([`map_sqlx_error`]) |
//! | Schema | embedded migrations ([`PostgresOutboxStore::migrate`]) or plain SQL (`sql/*.sql`, [`outbox_schema_sql`]); schema and table names configurable, validated and quoted; upgrades run beside relays of the previous version (the migration runner locks what a migration rewrites), except that migration 8 renames the acknowledgement columns: a relay of version 7 fails its completions until it is upgraded, and its events are published again (duplicates, no loss; docs/transports.md §2) |
//! | CDC (logical replication) | not yet |
//!
//! ## Example
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_core::prelude::*;
//! use outbox_core::{ClaimMode, ClaimRequest, Envelope};
//! use outbox_postgres::{PostgresInboxStore, PostgresOutboxStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/postgres").await?;
//! let store = PostgresOutboxStore::builder(pool.clone())
//!     .schema("shop")
//!     .claim_mode(ClaimMode::lease(Duration::from_secs(30))?)
//!     .build()?;
//! store.migrate().await?; // or run outbox_postgres::outbox_schema_sql("shop", "outbox_events")
//!
//! // In the business transaction:
//! let mut tx = pool.begin().await?;
//! // sqlx::query("UPDATE orders ...").execute(&mut *tx).await?;
//! let event = Envelope::builder("order", "o-42", 1, "order.created")
//!     .json(&serde_json::json!({"total_cents": 1999}))?
//!     .build()?;
//! store.append_many(&mut *tx, &[event]).await?;
//! tx.commit().await?;
//!
//! // A relay (normally outbox_core::Relay with outbox_core::driver::run):
//! let wake = std::sync::Arc::new(tokio::sync::Notify::new());
//! let _listener = store.spawn_listener(wake.clone())?;
//! let batch = store.claim(&ClaimRequest::new("relay-1", 1000)).await?;
//! assert!(batch.records.len() <= 1);
//!
//! let inbox = PostgresInboxStore::builder(pool).schema("shop").build()?;
//! inbox.migrate().await?;
//! # Ok(()) }
//! ```
//!
//! The mechanism, its durability and its cost are described below (`docs/claims.md`).
//!
//! ## Connections
//!
//! **Applications** may append through any pool, a transaction-mode pooler included: an append
//! is one statement in the caller's transaction and takes only transaction-level locks.
//!
//! **The relay** (the store a relay claims through, and its listener) needs connections that
//! each keep one server session: connect it **directly**, or through a pooler in **session
//! mode** (PgBouncer `pool_mode = session`). Its wake-up gate holds a session advisory lock
//! across transactions and its listener a `LISTEN`, which belong to the server session that
//! took them; behind a pooler in transaction mode (PgBouncer `pool_mode = transaction`) the
//! next transaction of the same connection may run on another session. The gate checks this
//! (`pg_backend_pid()` of every gate statement, a second pool connection's pid when it opens,
//! and `pg_advisory_unlock`'s result; see [`PostgresOutboxStore::wake_gate_disabled`]) and turns
//! itself off with one warning: the relay then polls at its idle backoff (`idle_max`, 1 s in
//! the `outbox` relay) instead of being woken, and its `LISTEN` notifications may be lost.
//! Nothing is lost or held either way; only the wake-up latency grows. Note also that sqlx
//! prepares every statement with parameters under a name, and PgBouncer before 1.21 (or later
//! with `max_prepared_statements = 0`) cannot carry named prepared statements in transaction
//! mode: such a statement fails when its next use lands on another server session.
//!
//! ## Tests
//!
//! The integration tests need a PostgreSQL server (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`; each test uses its own schema). They fail
//! with a clear message when the server is unreachable, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

#![doc = include_str!("../docs/claims.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
mod inbox;
mod inbox_parking;
mod listener;
mod outbox;
mod schema;
mod sql;
#[cfg(feature = "sql-mutation")]
#[doc(hidden)]
pub mod sql_mutation;

pub use config::{
    AppendGuard, OutboxSettings, DEFAULT_GAP_TIMEOUT, DEFAULT_INBOX_TABLE, DEFAULT_LATENCY_SAMPLE,
    DEFAULT_OUTBOX_TABLE, DEFAULT_SCHEMA,
};
pub use error::{classify_sqlstate, map_sqlx_error};
pub use inbox::{PostgresInboxStore, PostgresInboxStoreBuilder};
pub use outbox::{
    IntervalCount, LatencySummary, PostgresOutboxStore, PostgresOutboxStoreBuilder,
    PublishedFilter, PublishedPosition, PublishedRow, RecordedTopic,
};
pub use schema::{
    inbox_migrations, inbox_schema_sql, outbox_migrations, outbox_schema_sql, qualified,
    quote_identifier, validate_identifier, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN,
};

/// The sqlx version this crate is built against, re-exported for callers' transactions.
pub use sqlx;

#[cfg(test)]
mod send_checks {
    #[allow(dead_code)]
    fn futures_are_send(s: &crate::PostgresOutboxStore, i: &crate::PostgresInboxStore) {
        fn is_send<T: Send>(_: T) {}
        is_send(s.migrate());
        is_send(i.migrate());
        is_send(s.append_many(s.pool(), &[]));
        is_send(s.explain_claim(1));
    }
}
