//! # outbox-mysql
//!
//! The transactional outbox and the consumer inbox on MySQL 8.0.13+ and MariaDB 10.6+ (InnoDB;
//! sqlx 0.8): [`MySqlOutboxStore`] implements [`outbox_core::OutboxStore`] and
//! [`MySqlInboxStore`] implements [`outbox_core::InboxStore`] and
//! [`outbox_core::InboxParking`]. It passes the same conformance suites as the PostgreSQL and
//! in-memory stores, against MariaDB 10.11 in this repository's tests.
//!
//! ## Capabilities
//!
//! | Capability | Support |
//! |---|---|
//! | Append in the caller's transaction | yes: `AppendStore::append(&mut *tx, ..)` (`Tx = MySqlConnection`) or the inherent [`MySqlOutboxStore::append`] / [`MySqlOutboxStore::append_many`], generic over sqlx's MySQL executors; [`MySqlOutboxStore::append_many_in`] on a connection for batches of any size |
//! | Batch append | one multi-row INSERT (up to 500 events / 4 MiB, one round trip); `append_many_in` splits larger batches inside a savepoint, all or nothing |
//! | Validation at append | envelope limits, before anything is written; aggregate type and id at most [`outbox_core::MAX_AGGREGATE_NAME_BYTES`] (1,024 bytes) each whatever the name limit (the bound of every store; `build()` refuses a higher one), and `created_at` from the year 1000 (MySQL's `DATETIME`) |
//! | Backpressure hook | [`AppendGuard`] (thresholds are the caller's) |
//! | Claim: lease with fencing | `ClaimMode::Lease { duration }` (at most an hour): unique token on the claimed event row (`claim_token`, written with its `next_attempt_at`, the expiry on the database clock), owner and expiry in one `<table>_lease` row per batch; `complete` applies only where the row still carries the token (checked in the writing statement), the rest is `superseded_events`; `release_claims_of` ends the leases of a relay that is gone |
//! | Relay registry | `RelayRegistry` in `<table>_relays` (migration 4): register, heartbeat, deregister on the database clock; `live_claims_of` counts what `release_claims_of` would end, and a released row is marked possibly sent (its next publication counts as a re-publication) |
//! | Claim: locked transaction | `ClaimMode::LockedTransaction`: the claim's own connection keeps the aggregates' state rows and the claimed rows locked until `complete`/`release`; the session's `wait_timeout` (`locked_max_hold`, whole seconds) ends a claim a stuck relay never finishes; a crash closes the connection and InnoDB rolls back |
//! | Per-aggregate order, several relays | yes: only the head at `last_version + 1`; gaps held then parked, out-of-order versions parked (the same rule as PostgreSQL) |
//! | Rows committing out of id order | never skipped (no high-water mark) |
//! | Aggregate names up to the bound | yes, 1,024 bytes each: every index and lock uses a 32-byte SHA-256 key (a stored generated column), never the names (two of 1,024 bytes do not fit an InnoDB key, 3,072 bytes); a stored event past the bound (written by other means) is parked by the claim before any state of its aggregate is written, and can be discarded, not retried or re-issued |
//! | Durability | the server's (`innodb_flush_log_at_trx_commit = 1`): checked by [`check_durability`] / [`MySqlOutboxStore::check_durability`], which refuse any other value |
//! | Wake-up | no LISTEN/NOTIFY: relays poll with jittered backoff; in-process wake-up of subscribed relays after [`MySqlOutboxStore::commit_and_wake`] |
//! | Deadlocks, lock wait timeouts | transient `Conflict`; the store runs the whole transaction again (a few times) |
//! | Parking, retry/discard/re-issue, audit | yes, `<table>_audit`; a message parked once per dedup id and aggregate (inbox migration 3) |
//! | Cleanup | bounded batches (one transaction each, `SKIP LOCKED`), optional `<table>_archive` |
//! | Stats | backlog, in flight, parked, blocked (behind a parked event), gap-held (a held head and what follows it), aggregates with a gap held, oldest claimable/blocked/parked ages from the insertion time on the database clock, counted as outbox-postgres counts them; queued rows and table size in `extra` |
//! | Operator reads | [`outbox_core::ReportingStore`] (held to the reporting conformance suite; `outbox status` reads it on a `mysql://` URL), over [`MySqlOutboxStore::publish_latency`] (percentiles over a window), [`MySqlOutboxStore::published_events`] (publication order, paged by position) and [`MySqlOutboxStore::count_published`] for replay, [`MySqlOutboxStore::cleanup_candidates`], [`MySqlOutboxStore::interval_counts`] and [`MySqlOutboxStore::published_ids`] for reconciliation: the value types are outbox-core's. Not here: its conditional-update conflict counter and recorded topic facts (tables of their own) |
//! | Error mapping | server error numbers / SQLSTATE / sqlx variants to transient or permanent ([`map_sqlx_error`], [`classify_mysql_error`]) |
//! | Schema | embedded migrations serialized by a named lock ([`MySqlOutboxStore::migrate`]) or plain SQL ([`outbox_schema_sql`]); database and table names configurable, validated and quoted; each migration's DDL waits at most [`MIGRATION_DDL_WAIT_SECS`] for its table; outbox migration 2 renames the acknowledgement columns, so a relay of the previous version fails its completions until it is upgraded and its events are published again (duplicates, no loss; docs/transports.md §2) |
//! | Inbox deduplication | in the effect's transaction; the original-id dedupe of a re-issued copy scoped to its aggregate ([`outbox_core::InboxStore::register_for`]: each registration keeps a hash of its aggregate, inbox migration 2) |
//! | Names compared by the server | consumer names and relay owners: `utf8mb4_bin` is a PAD SPACE collation (`'a ' = 'a'`), so a consumer name ending with a space is refused ([`check_consumer_name`]; on PostgreSQL it would be another consumer) and `release_claims_of` compares the owner byte for byte |
//! | CDC (binlog) | not yet |
//!
//! ## Example
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_core::prelude::*;
//! use outbox_core::{ClaimMode, ClaimRequest, Envelope};
//! use outbox_mysql::{MySqlInboxStore, MySqlOutboxStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::MySqlPool::connect("mysql://root@127.0.0.1:3306/test").await?;
//! let store = MySqlOutboxStore::builder(pool.clone())
//!     .claim_mode(ClaimMode::lease(Duration::from_secs(30))?)
//!     .build()?;
//! store.migrate().await?;
//! let report = store.check_durability().await?;
//! assert!(!report.refused(), "{:?}", report.findings);
//!
//! // In the business transaction:
//! let mut tx = pool.begin().await?;
//! // sqlx::query("UPDATE orders ...").execute(&mut *tx).await?;
//! let event = Envelope::builder("order", "o-42", 1, "order.created")
//!     .json(&serde_json::json!({"total_cents": 1999}))?
//!     .build()?;
//! store.append_many(&mut *tx, &[event]).await?;
//! store.commit_and_wake(tx).await?; // wakes this process's relays at once
//!
//! let batch = store.claim(&ClaimRequest::new("relay-1", 100)).await?;
//! assert!(batch.records.len() <= 1);
//!
//! let inbox = MySqlInboxStore::builder(pool).build()?;
//! inbox.migrate().await?;
//! # Ok(()) }
//! ```
//!
//! ## Tests
//!
//! The integration tests need a MySQL 8 or MariaDB 10.6+ server (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`; each test creates its own database). They fail with a
//! clear message when the server is unreachable, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

#![doc = include_str!("../docs/claims.md")]

mod config;
mod durability;
mod error;
mod inbox;
mod inbox_parking;
mod outbox;
mod schema;

pub use config::{
    AppendGuard, OutboxSettings, DEFAULT_GAP_TIMEOUT, DEFAULT_INBOX_TABLE, DEFAULT_OUTBOX_TABLE,
};
pub use durability::{
    check_durability, judge, Check, DurabilityReport, Finding, Flavor, ServerSettings, Severity,
};
pub use error::{classify_mysql_error, codes, map_sqlx_error};
pub use inbox::{check_consumer_name, MySqlInboxStore, MySqlInboxStoreBuilder, MAX_CONSUMER_LEN};
pub use outbox::{
    IntervalCount, LatencySummary, MySqlOutboxStore, MySqlOutboxStoreBuilder, PublishedFilter,
    PublishedPosition, PublishedRow, WakeSubscription,
};
pub use schema::{
    inbox_migrations, inbox_schema_sql, outbox_migrations, outbox_schema_sql, qualified,
    quote_identifier, validate_identifier, MigrationStatus, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN,
    MIGRATION_DDL_WAIT_SECS, MIGRATION_LOCK,
};

/// The sqlx version this crate is built against, re-exported for callers' transactions.
pub use sqlx;

#[cfg(test)]
mod send_checks {
    #[allow(dead_code)]
    fn futures_are_send(s: &crate::MySqlOutboxStore, i: &crate::MySqlInboxStore) {
        fn is_send<T: Send>(_: T) {}
        is_send(s.migrate());
        is_send(i.migrate());
        is_send(s.append_many(s.pool(), &[]));
        is_send(s.check_durability());
    }
}
