//! # outbox-postgres
//!
//! The transactional outbox and the consumer inbox on PostgreSQL (sqlx 0.8):
//! [`PostgresOutboxStore`] implements [`outbox_core::OutboxStore`] and [`PostgresInboxStore`]
//! implements [`outbox_core::InboxStore`].
//!
//! ## Capabilities
//!
//! | Capability | Support |
//! |---|---|
//! | Append in the caller's transaction | yes: `OutboxStore::append(&mut *tx, ..)` (`Tx = PgConnection`) or the inherent [`PostgresOutboxStore::append`] / [`PostgresOutboxStore::append_many`], generic over any sqlx executor |
//! | Batch append | one statement, one round trip (`INSERT .. SELECT FROM UNNEST(arrays)`) |
//! | Validation at append | envelope limits, before anything is written |
//! | Backpressure hook | [`AppendGuard`] (thresholds are the caller's) |
//! | Claim: locked transaction | `ClaimMode::LockedTransaction`: aggregate advisory locks taken with `pg_try_advisory_xact_lock` (busy aggregates are skipped), held by the claim's transaction until `complete`/`release`; no row locks are needed, since every writer of a pending row takes its aggregate's lock first |
//! | Claim: lease with fencing | `ClaimMode::Lease { duration }`: owner, unique token, expiry on the database clock, in the narrow `<table>_lease` table (one row per aggregate in flight); `complete` applies only where the token matches, the rest is counted as `superseded`; `lease_remaining` tells the relay its deadline |
//! | Lease vs. delivery timeout | rejected by `build()` with [`PostgresOutboxStoreBuilder::publisher_delivery_timeout`] (and by `outbox_core::Relay::new`) |
//! | Per-aggregate order, several relays | yes, head-of-line only; see below |
//! | Rows committing out of id order | never skipped (no high-water mark) |
//! | Wake-up | `NOTIFY` in every append, [`PostgresOutboxStore::spawn_listener`] for `outbox_core::driver::run` |
//! | Parking, retry/discard/re-issue, audit | yes, `<table>_audit` |
//! | Cleanup | bounded batches (one transaction each), optional `<table>_archive` |
//! | Stats | backlog, in flight, parked, oldest ages; table/index size, dead tuples, autovacuum age in `extra` |
//! | Error mapping | SQLSTATE / sqlx variants to transient or permanent ([`map_sqlx_error`]) |
//! | Schema | embedded migrations ([`PostgresOutboxStore::migrate`]) or plain SQL (`sql/*.sql`, [`outbox_schema_sql`]); schema and table names configurable, validated and quoted |
//! | CDC (logical replication) | not yet |
//!
//! ## Example
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_core::{ClaimMode, ClaimRequest, Envelope, OutboxStore};
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
//! ## How order holds with several relays (and what it costs)
//!
//! Only an aggregate's **head** (lowest `aggregate_version` that is neither published nor
//! discarded; ties by insertion id) is ever claimed, nothing of an aggregate whose head is
//! parked, and never a second row of an aggregate while one of its rows is in flight.
//!
//! * **Candidates.** A partial index holds only pending rows that are not `blocked`
//!   (`WHERE status = 'pending' AND NOT blocked`). A claim walks it in id order (oldest
//!   first). Published, parked, discarded and blocked rows are not in it, so the walk never
//!   crosses the backlog queued behind heads; it crosses at most the rows in flight or waiting
//!   for a retry. New rows enter unblocked; a claim that meets a candidate which is not its
//!   aggregate's head marks it `blocked` (out of the index), once.
//! * **Aggregate key.** An aggregate is identified by a 64-bit key,
//!   `hashtextextended(aggregate_type || chr(31) || aggregate_id, 0)`, the leading column of
//!   the index of unfinished rows (pending or parked, in version order) and of the small index
//!   of blocked rows. Probing 64-bit keys costs a fraction of comparing two collated text
//!   columns. Its advisory lock and lease key is that key XOR a per-table seed, so two tables
//!   never share locks, and two aggregates whose keys collide (odds about 1 in 2^64 per pair)
//!   are ordered and locked as one: serialized, never reordered.
//! * **Aggregate locks.** While walking, the claim takes `pg_try_advisory_xact_lock` on the
//!   aggregate's lock key and skips aggregates another transaction holds (and, in lease mode,
//!   aggregates with a live lease). A candidate is its aggregate's head when no unfinished row
//!   of the aggregate is ordered before it: one probe of the unfinished index, which stops at
//!   the first entry it meets.
//! * **One statement in the common case.** The claim statement's snapshot predates its locks,
//!   so a transaction that held an aggregate may have committed changes it does not show. A
//!   candidate is claimed by that first statement only when nothing can have changed under
//!   it: its row version was never updated or locked (`xmax = 0`) and no unfinished row of its
//!   aggregate precedes it in the snapshot. Every change that could make it unclaimable either
//!   updates the row itself or leaves an earlier row of the aggregate visible to that snapshot
//!   (a head in flight, a parked row), and in lease mode a lease taken meanwhile is caught by
//!   the lease insert's `ON CONFLICT`, which always sees the latest lease. The other
//!   candidates are re-read by a *second statement* in a snapshot taken after the locks: still
//!   pending, unblocked and due, and the head? Heads are claimed (lease mode: `INSERT .. ON
//!   CONFLICT` into the lease table, refused while a live lease exists), the rest are blocked.
//!   Fresh rows, and rows whose predecessor was published by an earlier, committed
//!   completion, take the one-statement path. Two relays claiming at once never take two
//!   rows of one aggregate: the second one either cannot lock the aggregate or sees the first
//!   one's committed lease.
//! * **Leases** live in `<table>_lease`, one narrow row per aggregate in flight, keyed by the
//!   aggregate's lock key. "Is this aggregate in flight?" is one primary-key probe (in the
//!   candidate scan, so in-flight aggregates do not fill a batch, and again in the head check),
//!   and claiming writes a small row instead of rewriting the wide event row (whose update
//!   would also touch every index). `complete` releases the claim's leases where the token
//!   still matches and applies outcomes to exactly those rows (fencing); an expired or
//!   released lease is taken over by the next claim (`INSERT .. ON CONFLICT DO UPDATE .. WHERE
//!   expired`), in place: a released lease keeps its row, so an active aggregate's lease row is
//!   only ever HOT-updated (no index churn); `cleanup` deletes the lease rows of aggregates that
//!   stayed quiet for the retention period. Two aggregates whose 64-bit keys collide share one
//!   lease slot: they are only serialized.
//! * **Unblocking.** `complete` of a published head takes the same aggregate locks (blocking,
//!   sorted, keys carried from the claim) and unblocks the aggregate's first blocked row in the
//!   same statement; operator discard and re-issue do the same. Classification and unblocking
//!   of one aggregate are serialized by the lock and each reads a snapshot taken after it, so the
//!   invariant "an aggregate's lowest unfinished row is never blocked" holds and no row is left
//!   blocked behind a finished head.
//! * **Producers never wait** for relays: append is a plain insert (new rows are candidates)
//!   and takes no lock. A row that commits late (out of id order) is simply a candidate once
//!   visible; nothing depends on a high-water mark. A late row with a *lower* version than a
//!   row in flight waits until that row is finished (the lease probe, or the aggregate lock in
//!   locked mode).
//! * **Locked-transaction mode** keeps the aggregate locks until the batch is marked (no row
//!   locks: claims, completions and operator actions all take the aggregate lock before they
//!   write a pending row); a crashed relay's connection drops and releases them, and
//!   `idle_in_transaction_session_timeout` ([`OutboxSettings::locked_max_hold`]) ends a claim
//!   that a live but stuck process never finishes. Aggregates whose candidates were only
//!   blocked (not claimed) also stay locked until then; other relays skip them meanwhile.
//!
//! **Cost.** Per event: the insert; in lease mode one narrow lease row written at claim and
//! at completion; one write of the event row to mark it; a
//! row queued behind its aggregate's head pays one more write to block it and one to unblock
//! it. Per batch: claim = BEGIN, one statement (candidates, locks, head check, leases), a
//! second one only for candidates that need a re-check, COMMIT; completion = BEGIN, lock
//! (lease mode), one statement from arrays (fence, outcomes, unblocking; a shorter form when
//! every outcome is a publication), COMMIT; no per-row round trips. Claim cost grows with the batch size and the number of heads in flight or waiting
//! for a retry, not with the backlog: `EXPLAIN (ANALYZE, BUFFERS)` of a claim of 1,000 rows
//! (10,000 aggregates) at 10,000 and at 1,000,000 queued rows reads, for the claim statement,
//! about 2,040 vs 3,040 buffers in locked mode (2.4 vs 4.7 ms) and 9,260 vs 10,260 in lease
//! mode (which also probes and writes the leases), and for the re-check statement, were every
//! candidate to need it, 4,040 vs 6,040 (locked) and 8,040 vs 10,040 (lease): one more
//! B-tree level per lookup, see `examples/claim_bench.rs`. Aggregate key collisions only
//! serialize two unrelated aggregates. With the relay's prefetch, the next claim overlaps the
//! completion: `claim_bench` drains about 77,000 events/s through `outbox_core::Relay` in
//! locked mode and 48,000 in lease mode on 2 cores (naive `SKIP LOCKED`: 93,000), with a
//! publisher that acknowledges at once. The `NOTIFY` of each append takes a short global lock
//! at commit; turn it off (`notify_channel(None)`) for very high append rates and rely on
//! polling.
//!
//! ## Durability of completions
//!
//! Completions commit with `synchronous_commit = off` by default (no wait for the WAL flush;
//! [`PostgresOutboxStoreBuilder::synchronous_completion`] turns this off). This is safe under
//! at-least-once delivery: a completion lost in a server crash leaves its rows unpublished (in
//! lease mode still leased until expiry), so they are published again, a duplicate and never a
//! loss. Order holds too: the aggregate's next version can only be handed out by a later claim
//! that saw the completion. In lease mode that claim commits synchronously, which flushes the
//! WAL up to and including the earlier completion's commit record before the relay publishes
//! anything. In locked mode the next claim publishes inside its open transaction, so a crash
//! can lose both completions and the aggregate is sent again from the lost one on: again only
//! duplicates of events that were already delivered in order. Lease claims and operator
//! actions always commit synchronously: a lost lease could let a second relay publish while
//! the first one still is.
//!
//! ## Tests
//!
//! The integration tests need a PostgreSQL server (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`; each test uses its own schema). They fail
//! with a clear message when the server is unreachable, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
mod inbox;
mod listener;
mod outbox;
mod schema;
mod sql;

pub use config::{
    AppendGuard, OutboxSettings, DEFAULT_GAP_TIMEOUT, DEFAULT_INBOX_TABLE, DEFAULT_OUTBOX_TABLE,
    DEFAULT_SCHEMA,
};
pub use error::{classify_sqlstate, map_sqlx_error};
pub use inbox::{PostgresInboxStore, PostgresInboxStoreBuilder};
pub use outbox::{PostgresOutboxStore, PostgresOutboxStoreBuilder};
pub use schema::{
    inbox_schema_sql, outbox_schema_sql, qualified, quote_identifier, validate_identifier,
    MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN,
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
