//! Adversarial checks of lease mode with the lease on the claimed event row (migration 3,
//! `claim_token` + `<table>_lease`), against the real server: takeovers racing the old
//! relay's completion in both orders, release by owner racing a completion, the cleanup of
//! lease rows racing a slow completion and a live claim, operator actions beside a leased
//! version, `accept_first_version` with a leased head, clock edges on a frozen database clock,
//! a completion killed in the middle of its transaction, and a relay of the previous version
//! (its statements as they ran before migration 3) beside this one.
//!
//! Interleavings are forced with transactions held on other connections; a waiting statement
//! is recognised in `information_schema.PROCESSLIST`. Each test uses its own database. Needs
//! MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimedBatch, Envelope, OperatorAction};
use outbox_mysql::MySqlOutboxStore;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Executor, MySqlPool};
use uuid::Uuid;

use common::lease::{ids, park_a_copy_beside_its_uncommitted_twin, status_of};
use common::{claim, event, lease, published, versions};

/// (status, claim token, `next_attempt_at` in the future, `maybe_delivered`, ack position) of
/// the row of event `e`.
async fn row(ctx: &common::Ctx, e: &Envelope) -> (String, Uuid, bool, bool, Option<i64>) {
    sqlx::query_as(&format!(
        "SELECT CAST(status AS CHAR), claim_token, next_attempt_at > UTC_TIMESTAMP(6), \
                maybe_delivered = 1, ack_position \
         FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// The row's park kind (`None` unless parked).
async fn park_kind(ctx: &common::Ctx, e: &Envelope) -> Option<String> {
    sqlx::query_scalar(&format!(
        "SELECT CAST(park_kind AS CHAR) FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// The aggregate's `last_version`.
async fn last_version(ctx: &common::Ctx, agg: &str) -> Option<i64> {
    sqlx::query_scalar(&format!(
        "SELECT last_version FROM {} WHERE aggregate_id = ?",
        ctx.table("outbox_events_aggregate")
    ))
    .bind(agg)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// The lease rows' tokens.
async fn lease_tokens(ctx: &common::Ctx) -> Vec<Uuid> {
    sqlx::query_scalar(&format!(
        "SELECT token FROM {} ORDER BY token",
        ctx.table("outbox_events_lease")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// A READ COMMITTED transaction on a connection of its own.
async fn held(ctx: &common::Ctx) -> sqlx::pool::PoolConnection<sqlx::MySql> {
    let mut conn = ctx.pool.acquire().await.unwrap();
    conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await
        .unwrap();
    conn
}

/// The ids of the connections running a statement on this test's database that starts with
/// `prefix` and contains `part` (other than the caller's).
async fn running(ctx: &common::Ctx, prefix: &str, part: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT ID FROM information_schema.PROCESSLIST \
         WHERE ID <> CONNECTION_ID() AND INSTR(INFO, ?) > 0 AND INSTR(INFO, ?) > 0 \
           AND INFO LIKE CONCAT(?, '%')",
    )
    .bind(&ctx.database)
    .bind(part)
    .bind(prefix)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Waits until `n` statements of this test's database starting with `prefix` and containing
/// `part` are held up in the server; returns their connection ids.
async fn wait_waiting(ctx: &common::Ctx, prefix: &str, part: &str, n: usize) -> Vec<i64> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ids = running(ctx, prefix, part).await;
        if ids.len() >= n {
            // Still there a moment later: held up, not just running.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let again = running(ctx, prefix, part).await;
            if again.len() >= n {
                return again;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{n} statement(s) `{prefix}..{part}..` never waited on {}",
            ctx.database
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Claims until the batch is not empty (a lease ends on the database clock).
async fn claim_after_expiry(s: &MySqlOutboxStore, owner: &str) -> ClaimedBatch {
    for _ in 0..100 {
        let b = claim(s, owner, 10).await;
        if !b.records.is_empty() {
            return b;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing claimable after the lease ended");
}

/// Holds a lock on the lease row of `token` (every statement of a lease completion that
/// deletes it waits there, after the marking).
async fn hold_lease_row(ctx: &common::Ctx, token: Uuid) -> sqlx::pool::PoolConnection<sqlx::MySql> {
    let mut c = held(ctx).await;
    let n: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT token FROM {} WHERE token = ? FOR UPDATE",
        ctx.table("outbox_events_lease")
    ))
    .bind(token)
    .fetch_all(&mut *c)
    .await
    .unwrap();
    assert_eq!(n.len(), 1, "the batch has its lease row");
    c
}

/// Holds every gap of the lease table (REPEATABLE READ next-key locks up to the supremum):
/// a claim's lease-row insert waits there, after the claim locked its rows and aggregates.
async fn hold_lease_inserts(ctx: &common::Ctx) -> sqlx::pool::PoolConnection<sqlx::MySql> {
    let mut c = ctx.pool.acquire().await.unwrap();
    c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; START TRANSACTION")
        .await
        .unwrap();
    sqlx::query(&format!(
        "SELECT token FROM {} WHERE until > '1000-01-01' FOR UPDATE",
        ctx.table("outbox_events_lease")
    ))
    .fetch_all(&mut *c)
    .await
    .unwrap();
    c
}

/// Order 1: the takeover claim holds the aggregate (it waits on its lease-row insert, a held
/// gap lock) while the old relay's completion, after its lease ended, waits for the state-row
/// lock; the takeover commits first. The old completion applies nothing (superseded), the row
/// keeps the new token, and only the new claim's publication is recorded. (Seen failing with
/// `AND e.claim_token = ?` removed from the joined marking: the old completion marked the row
/// published under the new claim.) The takeover is another relay's store instance, with a
/// lease of its own long enough to be live still when it is checked: a lease of 0.3 s, read
/// before the takeover waited on the held inserts, ended before that check whenever the waits
/// and the old completion took longer (it did under load, on any version of the claim).
#[tokio::test]
async fn a_takeover_that_commits_first_fences_the_waiting_old_completion() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(0.3)).await;
    let s_new = ctx.store(lease(30.0)).await;
    let e = event("a", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let old = claim(&s, "relay-old", 10).await;
    assert_eq!(ids(&old), vec![e.event_id]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let gaps = hold_lease_inserts(&ctx).await;
    let taking = {
        let s = s_new.clone();
        tokio::spawn(async move { claim(&s, "relay-new", 10).await })
    };
    wait_waiting(&ctx, "INSERT", "outbox_events_lease", 1).await;
    let completing = {
        let (s, h, e) = (s.clone(), old.handle.clone(), e.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
    gaps.close().await.unwrap();
    let new = taking.await.unwrap();
    assert_eq!(ids(&new), vec![e.event_id], "the takeover");
    assert!(new.records[0].maybe_sent_before);
    let rep = completing.await.unwrap().unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    assert_eq!(rep.superseded_events, vec![e.event_id]);
    let (status, token, leased, maybe, ack) = row(&ctx, &e).await;
    assert_eq!(
        (status.as_str(), token, leased, maybe, ack),
        ("pending", new.handle.token, true, true, None)
    );
    assert_eq!(lease_tokens(&ctx).await, vec![new.handle.token]);
    let rep = s_new
        .complete(&new.handle, &[published(&e, 2)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 1);
    assert_eq!(row(&ctx, &e).await.4, Some(2));
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    ctx.drop().await;
}

/// Order 2: the old relay's completion, its lease ended, holds the aggregate and is held up
/// after its marking (its lease-row delete waits on a held lock); a claim meanwhile takes
/// nothing over (the row and the aggregate are the completion's), and once the completion
/// commits its publication stands, with the last version, and nothing is handed out again.
/// (Seen failing with the marking also requiring a live lease, `next_attempt_at >
/// UTC_TIMESTAMP(6)`: the expired claim's publication was refused and the row handed out
/// again.)
#[tokio::test]
async fn an_expired_completion_that_holds_the_aggregate_is_never_overtaken() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(0.3)).await;
    let (e1, e2) = (event("a", 1), event("a", 2));
    common::append(&ctx, &s, &[e1.clone(), e2.clone()]).await;
    let old = claim(&s, "relay-old", 10).await;
    assert_eq!(ids(&old), vec![e1.event_id]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let blocker = hold_lease_row(&ctx, old.handle.token).await;
    let completing = {
        let (s, h, e) = (s.clone(), old.handle.clone(), e1.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
    };
    wait_waiting(&ctx, "DELETE", "outbox_events_lease", 1).await;
    let during = claim(&s, "relay-new", 10).await;
    assert!(
        during.records.is_empty(),
        "handed out {:?} while the completion held the aggregate",
        versions(&during)
    );
    blocker.close().await.unwrap();
    let rep = completing.await.unwrap().unwrap();
    assert_eq!((rep.applied, rep.superseded), (1, 0), "{rep:?}");
    assert_eq!(row(&ctx, &e1).await.0, "published");
    assert_eq!(row(&ctx, &e1).await.4, Some(1));
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    let next = claim(&s, "relay-new", 10).await;
    assert_eq!(ids(&next), vec![e2.event_id], "the next version, once");
    assert!(!next.records[0].maybe_sent_before);
    ctx.drop().await;
}

/// Holds the state row of `agg` (`FOR UPDATE`) on a connection of its own.
async fn hold_aggregate(ctx: &common::Ctx, agg: &str) -> sqlx::pool::PoolConnection<sqlx::MySql> {
    let mut c = held(ctx).await;
    sqlx::query(&format!(
        "SELECT aggregate_key FROM {} WHERE aggregate_id = ? FOR UPDATE",
        ctx.table("outbox_events_aggregate")
    ))
    .bind(agg)
    .fetch_one(&mut *c)
    .await
    .unwrap();
    c
}

/// The audited releases.
async fn releases(s: &MySqlOutboxStore) -> usize {
    s.audit_trail(None)
        .await
        .unwrap()
        .iter()
        .filter(|a| a.action == OperatorAction::ReleaseClaim)
        .count()
}

/// `release_claims_of` and the relay's own completion queue on the aggregate's lock; the
/// release gets it first: it ends the claim (row due again without the token, audited), and
/// the completion that follows applies nothing; a claim then hands the row out again. (Seen
/// failing with `AND e.claim_token = ?` removed from the joined marking: the released row
/// was marked published by the relay declared gone, beside an audited release.)
#[tokio::test]
async fn a_release_by_owner_ahead_of_the_completion_fences_it() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(30.0)).await;
    let e = event("a", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let one = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&one), vec![e.event_id]);
    let lock = hold_aggregate(&ctx, "a").await;
    let releasing = {
        let s = s.clone();
        tokio::spawn(async move { s.release_claims_of("relay-1", "ops").await })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
    let completing = {
        let (s, h, e) = (s.clone(), one.handle.clone(), e.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 2).await;
    lock.close().await.unwrap();
    assert_eq!(releasing.await.unwrap().unwrap(), 1);
    let rep = completing.await.unwrap().unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    let (status, token, leased, _, ack) = row(&ctx, &e).await;
    assert_eq!(
        (status.as_str(), token, leased, ack),
        ("pending", Uuid::nil(), false, None)
    );
    assert_eq!(releases(&s).await, 1);
    assert!(lease_tokens(&ctx).await.is_empty());
    let again = claim(&s, "relay-2", 10).await;
    assert_eq!(ids(&again), vec![e.event_id]);
    common::publish_all(&s, &again).await;
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    ctx.drop().await;
}

/// The other order: the completion gets the aggregate's lock first and publishes; the release
/// by owner behind it finds nothing live to release (no audit entry, count 0) and leaves the
/// published row alone. (Seen failing with `status = 'pending'` removed from the release's
/// `UPDATE` and the marking keeping the claim's token instead of writing its marker: it
/// released, and audited, the published row. Either one alone still fences it.)
#[tokio::test]
async fn a_completion_ahead_of_the_release_by_owner_stands() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(30.0)).await;
    let (e1, e2) = (event("a", 1), event("a", 2));
    common::append(&ctx, &s, &[e1.clone(), e2.clone()]).await;
    let one = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&one), vec![e1.event_id]);
    let lock = hold_aggregate(&ctx, "a").await;
    let completing = {
        let (s, h, e) = (s.clone(), one.handle.clone(), e1.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
    let releasing = {
        let s = s.clone();
        tokio::spawn(async move { s.release_claims_of("relay-1", "ops").await })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 2).await;
    lock.close().await.unwrap();
    let rep = completing.await.unwrap().unwrap();
    assert_eq!(rep.applied, 1, "{rep:?}");
    assert_eq!(releasing.await.unwrap().unwrap(), 0);
    assert_eq!(releases(&s).await, 0);
    let (status, _, _, _, ack) = row(&ctx, &e1).await;
    assert_eq!((status.as_str(), ack), ("published", Some(1)));
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    let next = claim(&s, "relay-2", 10).await;
    assert_eq!(ids(&next), vec![e2.event_id]);
    ctx.drop().await;
}

/// Cleanup of lease rows beside a live claim and a slow completion: the expired batch's
/// completion is held up after its marking (on its own lease-row delete) while cleanup runs;
/// cleanup waits for it, then removes only expired rows; the completion's publication
/// stands; the live claim's lease row survives, so `release_claims_of` still finds its relay.
/// (Seen failing with cleanup deleting every lease row, `until > '1000-01-01'` for
/// `until < UTC_TIMESTAMP(6)`: the live relay's lease row was gone.)
#[tokio::test]
async fn lease_row_cleanup_spares_live_claims_and_slow_completions() {
    let ctx = ctx!(8);
    let short = ctx.store(lease(0.3)).await;
    let long = ctx.builder(lease(30.0)).build().unwrap();
    let (a, b) = (event("a", 1), event("b", 1));
    common::append(&ctx, &short, std::slice::from_ref(&a)).await;
    let slow = claim(&short, "relay-slow", 10).await;
    assert_eq!(ids(&slow), vec![a.event_id]);
    common::append(&ctx, &short, std::slice::from_ref(&b)).await;
    let live = claim(&long, "relay-live", 10).await;
    assert_eq!(ids(&live), vec![b.event_id]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let blocker = hold_lease_row(&ctx, slow.handle.token).await;
    let completing = {
        let (s, h, e) = (short.clone(), slow.handle.clone(), a.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
    };
    wait_waiting(&ctx, "DELETE", "outbox_events_lease", 1).await;
    let cleaning = {
        let s = short.clone();
        tokio::spawn(async move { s.cleanup(Duration::from_secs(3600), 100).await })
    };
    wait_waiting(&ctx, "DELETE", "outbox_events_lease", 2).await;
    blocker.close().await.unwrap();
    let rep = completing.await.unwrap().unwrap();
    assert_eq!(rep.applied, 1, "{rep:?}");
    cleaning.await.unwrap().unwrap();
    assert_eq!(row(&ctx, &a).await.0, "published");
    assert_eq!(lease_tokens(&ctx).await, vec![live.handle.token]);
    assert_eq!(
        long.release_claims_of("relay-live", "ops").await.unwrap(),
        1
    );
    let again = claim(&long, "relay-next", 10).await;
    assert_eq!(ids(&again), vec![b.event_id]);
    ctx.drop().await;
}

/// Operator actions on parked versions of an aggregate whose next version is leased: a gap
/// parked above it cannot be retried, discarded or re-issued while the leased version waits
/// below (refused, nothing written, nothing audited), and a duplicate parked below the last
/// version can be discarded without touching the leased row (its token and lease stay; no
/// claim hands out anything of the aggregate meanwhile). Once the leased version is published,
/// the gap's retry is accepted. (Seen failing with the operator's count of the versions
/// waiting below forced to 0: the gap's retry was accepted beside the leased version.)
#[tokio::test]
async fn operator_actions_beside_a_leased_version_change_only_their_event() {
    let ctx = ctx!(8);
    let s = ctx
        .builder(lease(30.0))
        .gap_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    s.migrate().await.unwrap();
    let (v1, v1dup, v2, v3) = (event("a", 1), event("a", 1), event("a", 2), event("a", 3));
    common::append(&ctx, &s, std::slice::from_ref(&v1)).await;
    common::publish_all(&s, &claim(&s, "relay", 10).await).await;
    // A duplicate of v1 arrives late: parked out of order.
    common::append(&ctx, &s, std::slice::from_ref(&v1dup)).await;
    let b = claim(&s, "relay", 10).await;
    assert!(b.records.is_empty());
    assert_eq!(
        park_kind(&ctx, &v1dup).await.as_deref(),
        Some("out_of_order")
    );
    // v3 before v2: held, then parked as a gap.
    common::append(&ctx, &s, std::slice::from_ref(&v3)).await;
    assert!(claim(&s, "relay", 10).await.records.is_empty());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(claim(&s, "relay", 10).await.records.is_empty());
    assert_eq!(park_kind(&ctx, &v3).await.as_deref(), Some("version_gap"));
    // v2 arrives and is leased.
    common::append(&ctx, &s, std::slice::from_ref(&v2)).await;
    let leased = claim(&s, "relay", 10).await;
    assert_eq!(ids(&leased), vec![v2.event_id]);
    let token = leased.handle.token;
    let unchanged = |r: (String, Uuid, bool, bool, Option<i64>)| {
        assert_eq!((r.0.as_str(), r.1, r.2), ("pending", token, true), "{r:?}");
    };
    assert_eq!(
        s.retry_parked(v3.event_id, "ops").await.unwrap_err().kind,
        outbox_core::StoreErrorKind::Conflict
    );
    assert!(s.discard_parked(v3.event_id, "ops", "gone").await.is_err());
    assert!(s.reissue_parked(v3.event_id, "ops", "copy").await.is_err());
    assert_eq!(row(&ctx, &v3).await.0, "parked");
    unchanged(row(&ctx, &v2).await);
    assert!(s.retry_parked(v1dup.event_id, "ops").await.is_err());
    s.discard_parked(v1dup.event_id, "ops", "a duplicate")
        .await
        .unwrap();
    unchanged(row(&ctx, &v2).await);
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    assert!(claim(&s, "relay-2", 10).await.records.is_empty());
    let audit = s.audit_trail(None).await.unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(
        (audit[0].event_id, audit[0].action),
        (v1dup.event_id, OperatorAction::Discard)
    );
    common::publish_all(&s, &leased).await;
    s.retry_parked(v3.event_id, "ops").await.unwrap();
    let next = claim(&s, "relay", 10).await;
    assert_eq!(ids(&next), vec![v3.event_id]);
    ctx.drop().await;
}

/// `accept_first_version`: an aggregate without a last version whose first version (5) is
/// leased; a lower version (3) committed later is never handed out: it waits while the lease
/// is live and is parked as out of order once version 5 is published, or, when the lease
/// ended without an outcome (the row still carries its token: it may have been sent), it is
/// parked by the claim that takes version 5 over; the leased version completes. (Seen failing with the
/// `claim_token` clause removed from `min_sent`: version 3 was handed out while version 5 was
/// in flight.)
#[tokio::test]
async fn accept_first_version_counts_a_leased_head_as_sent() {
    for expire in [false, true] {
        let ctx = ctx!(6);
        let s = ctx
            .builder(lease(if expire { 0.3 } else { 30.0 }))
            .accept_first_version(true)
            .build()
            .unwrap();
        s.migrate().await.unwrap();
        let (v5, v3) = (event("a", 5), event("a", 3));
        common::append(&ctx, &s, std::slice::from_ref(&v5)).await;
        let first = claim(&s, "relay-1", 10).await;
        assert_eq!(ids(&first), vec![v5.event_id]);
        if expire {
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        common::append(&ctx, &s, std::slice::from_ref(&v3)).await;
        let second = claim(&s, "relay-2", 10).await;
        assert!(
            !ids(&second).contains(&v3.event_id),
            "expire {expire}: version 3 handed out after version 5 was claimed"
        );
        if expire {
            // The ended lease was taken over (maybe sent) and completes; version 3 was parked
            // by the same claim.
            assert_eq!(ids(&second), vec![v5.event_id]);
            assert!(second.records[0].maybe_sent_before);
            common::publish_all(&s, &second).await;
        } else {
            // Version 3 waits while the lease is live, then is parked.
            assert!(second.records.is_empty());
            common::publish_all(&s, &first).await;
            assert!(claim(&s, "relay-2", 10).await.records.is_empty());
        }
        assert_eq!(
            park_kind(&ctx, &v3).await.as_deref(),
            Some("out_of_order"),
            "expire {expire}"
        );
        assert_eq!(last_version(&ctx, "a").await, Some(5));
        ctx.drop().await;
    }
}

/// A retry at once after an error that says the event was not delivered (a full local
/// queue), so nothing but a claim's token could make it "maybe sent".
fn not_sent(e: &Envelope) -> outbox_core::Outcome {
    outbox_core::Outcome::Retry {
        event_id: e.event_id,
        delay: Duration::ZERO,
        error: outbox_core::LastError {
            class: outbox_core::ErrorClass::Transient,
            kind: "queue_full".into(),
            message: "local queue full".into(),
        },
    }
}

/// A pool of one connection whose session clock is frozen at `clock` (seconds since the
/// epoch, microseconds): every statement of a store on it reads `UTC_TIMESTAMP(6)` there.
async fn frozen_pool(clock: Arc<AtomicI64>) -> MySqlPool {
    let url =
        std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let clock = clock.clone();
            Box::pin(async move {
                let us = clock.load(Ordering::SeqCst);
                sqlx::query(&format!(
                    "SET timestamp = {}.{:06}",
                    us / 1_000_000,
                    us % 1_000_000
                ))
                .execute(conn)
                .await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap()
}

/// Moves the frozen clock of `pool` (one connection) to `us`.
async fn set_clock(pool: &MySqlPool, clock: &AtomicI64, us: i64) {
    clock.store(us, Ordering::SeqCst);
    sqlx::query(&format!(
        "SET timestamp = {}.{:06}",
        us / 1_000_000,
        us % 1_000_000
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// Clock edges on a frozen database clock (lease 10 s, claimed at T): at T + 10 s − 1 µs the
/// row is neither due nor taken over; at exactly T + 10 s (`next_attempt_at` = now) it is
/// due and not leased, so it is taken over (maybe sent); a row never claimed (the all-zero
/// token) and a row whose retry or release cleared the token are not "maybe sent"; and a
/// completion long after its lease ended, with no takeover, still applies. (Seen failing with
/// the retry no longer clearing the token: the retried row was reported maybe sent; with the
/// lease test `next_attempt_at > now` written `>=`: the row due at exactly its expiry was not
/// taken over.)
#[tokio::test]
async fn clock_edges_on_a_frozen_database_clock() {
    let ctx = ctx!(4);
    ctx.store(lease(10.0)).await; // migrated on the shared pool
    let now: i64 = sqlx::query_scalar("SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)")
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    let t0 = now - now % 1_000_000; // whole seconds
    let clock = Arc::new(AtomicI64::new(t0));
    let pool = frozen_pool(clock.clone()).await;
    let s = MySqlOutboxStore::builder(pool.clone())
        .database(&ctx.database)
        .claim_mode(lease(10.0))
        .build()
        .unwrap();
    let (a, b, c, d) = (event("a", 1), event("b", 1), event("c", 1), event("d", 1));
    common::append(&ctx, &s, &[a.clone(), b.clone(), c.clone(), d.clone()]).await;
    // Rows inserted on the real clock: make them due on the frozen one.
    sqlx::query(&format!(
        "UPDATE {} SET next_attempt_at = '1000-01-01'",
        ctx.table("outbox_events")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let first = claim(&s, "relay-1", 2).await;
    assert_eq!(ids(&first), vec![a.event_id, b.event_id]);
    assert!(
        first.records.iter().all(|r| !r.maybe_sent_before),
        "the zero token is no claim"
    );
    let bc = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&bc), vec![c.event_id, d.event_id]);
    // Retries at once: the token goes with the claim.
    let rep = s
        .complete(&bc.handle, &[not_sent(&c), not_sent(&d)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 2);
    let again = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&again), vec![c.event_id, d.event_id]);
    assert!(
        again.records.iter().all(|r| !r.maybe_sent_before),
        "a retried row is not maybe sent"
    );
    s.release(&again.handle).await.unwrap();
    let third = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&third), vec![c.event_id, d.event_id]);
    assert!(
        third.records.iter().all(|r| !r.maybe_sent_before),
        "a released row is not maybe sent"
    );
    // One microsecond before the expiry of every claim (all made at t0): nothing.
    set_clock(&pool, &clock, t0 + 10_000_000 - 1).await;
    assert!(claim(&s, "relay-2", 10).await.records.is_empty());
    // At the expiry exactly: due, not leased, taken over (all four: c and d were claimed
    // again at t0 by `third`, which ended without an outcome).
    set_clock(&pool, &clock, t0 + 10_000_000).await;
    let taken = claim(&s, "relay-2", 10).await;
    assert_eq!(taken.records.len(), 4);
    assert!(taken.records.iter().all(|r| r.maybe_sent_before));
    // A completion an hour after its lease ended, with no takeover, applies.
    set_clock(&pool, &clock, t0 + 3_600_000_000).await;
    let outs: Vec<_> = [&a, &b, &c, &d]
        .iter()
        .enumerate()
        .map(|(i, e)| published(e, i as i64))
        .collect();
    let rep = s.complete(&taken.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 4, "{rep:?}");
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    pool.close().await;
    ctx.drop().await;
}

/// A lease completion killed in the middle of its transaction (the server kills its
/// connection after the marking, while it waits to delete its lease row): the marking is
/// rolled back, nothing is lost (the row stays pending under the claim's token, no last
/// version), and once the lease has ended the takeover hands it out as maybe sent and marks
/// it `maybe_delivered`; the next version follows. (Seen failing with `claim_token <> 0`
/// removed from the candidates' `sent_before`: the takeover reported a fresh send.)
#[tokio::test]
async fn a_completion_killed_mid_transaction_is_taken_over_as_maybe_sent() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(0.5)).await;
    let (e1, e2) = (event("a", 1), event("a", 2));
    common::append(&ctx, &s, &[e1.clone(), e2.clone()]).await;
    let c = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&c), vec![e1.event_id]);
    let blocker = hold_lease_row(&ctx, c.handle.token).await;
    let completing = {
        let (s, h, e) = (s.clone(), c.handle.clone(), e1.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
    };
    let conns = wait_waiting(&ctx, "DELETE", "outbox_events_lease", 1).await;
    sqlx::query(&format!("KILL CONNECTION {}", conns[0]))
        .execute(&ctx.pool)
        .await
        .unwrap();
    let res = completing.await.unwrap();
    assert!(res.is_err(), "the killed completion reported {res:?}");
    blocker.close().await.unwrap();
    let (status, token, _, maybe, ack) = row(&ctx, &e1).await;
    assert_eq!(
        (status.as_str(), token, maybe, ack),
        ("pending", c.handle.token, false, None),
        "the marking was rolled back"
    );
    assert_eq!(last_version(&ctx, "a").await, None);
    let taken = claim_after_expiry(&s, "relay-2").await;
    assert_eq!(ids(&taken), vec![e1.event_id]);
    assert!(taken.records[0].maybe_sent_before);
    assert!(row(&ctx, &e1).await.3, "maybe_delivered for good");
    common::publish_all(&s, &taken).await;
    let next = claim(&s, "relay-2", 10).await;
    assert_eq!(ids(&next), vec![e2.event_id]);
    assert!(!next.records[0].maybe_sent_before);
    ctx.drop().await;
}

/// Writes the lease a relay of the previous version writes at claim (before migration 3): the
/// lease in the aggregate's state row (owner, token, expiry, the row) and the row's
/// `next_attempt_at` at the expiry. Returns the token.
async fn old_claim(ctx: &common::Ctx, e: &Envelope, owner: &str, secs: f64) -> Uuid {
    let token = Uuid::now_v7();
    let us = (secs * 1e6) as i64;
    sqlx::query(&format!(
        "UPDATE {a} s JOIN {e} e ON e.aggregate_key = s.aggregate_key \
         SET s.lease_owner = ?, s.lease_token = ?, \
             s.lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, s.lease_row = e.id, \
             e.next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
         WHERE e.event_id = ?",
        a = ctx.table("outbox_events_aggregate"),
        e = ctx.table("outbox_events"),
    ))
    .bind(owner)
    .bind(token)
    .bind(us)
    .bind(us)
    .bind(e.event_id.as_uuid())
    .execute(&ctx.pool)
    .await
    .unwrap();
    token
}

/// What a relay of the previous version does on `conn` to complete `e` as published under
/// its state-row lease `token` (its statements before migration 3): lock the state row, apply
/// only when the state row carries its token and names the row, mark the row, end the lease
/// with the new last version. Returns whether it applied; leaves the transaction open.
async fn old_publish(
    ctx: &common::Ctx,
    conn: &mut sqlx::MySqlConnection,
    e: &Envelope,
    token: Uuid,
) -> bool {
    let (lease_token, lease_row, id): (Option<Uuid>, Option<i64>, i64) = sqlx::query_as(&format!(
        "SELECT s.lease_token, s.lease_row, \
                (SELECT id FROM {e} WHERE event_id = ?) \
         FROM {a} s WHERE s.aggregate_id = ? FOR UPDATE",
        a = ctx.table("outbox_events_aggregate"),
        e = ctx.table("outbox_events"),
    ))
    .bind(e.event_id.as_uuid())
    .bind(&e.aggregate_id)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    if lease_token != Some(token) || lease_row != Some(id) {
        return false;
    }
    let n = sqlx::query(&format!(
        "UPDATE {} SET status = 'published', published_at = UTC_TIMESTAMP(6), \
           finished_at = UTC_TIMESTAMP(6), ack_transport = 'kafka', ack_destination = 'orders', \
           ack_partition = 0, ack_position = 99 \
         WHERE id = ? AND status = 'pending'",
        ctx.table("outbox_events")
    ))
    .bind(id)
    .execute(&mut *conn)
    .await
    .unwrap()
    .rows_affected();
    sqlx::query(&format!(
        "UPDATE {} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
           lease_row = NULL, last_version = GREATEST(COALESCE(last_version, 0), ?) \
         WHERE aggregate_id = ?",
        ctx.table("outbox_events_aggregate")
    ))
    .bind(e.aggregate_version)
    .bind(&e.aggregate_id)
    .execute(&mut *conn)
    .await
    .unwrap();
    n == 1
}

/// A rolling upgrade, the takeover racing the old relay's completion: the old relay's lease
/// (in the state row) has ended; a claim of this version takes the aggregate over and waits
/// (its lease-row insert held up) while the old relay's completion waits for the state-row
/// lock; the takeover commits first, clearing the old lease, so the old completion applies
/// nothing and only the new claim's publication is recorded. (Seen failing with the takeover
/// no longer clearing the previous version's lease: the old relay marked the row published
/// under the new claim.)
#[tokio::test]
async fn an_old_relays_completion_behind_a_takeover_applies_nothing() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(30.0)).await;
    let (e0, e) = (event("a", 1), event("a", 2));
    common::append(&ctx, &s, std::slice::from_ref(&e0)).await;
    common::publish_all(&s, &claim(&s, "relay", 10).await).await;
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let old = old_claim(&ctx, &e, "relay-old", 0.3).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let gaps = hold_lease_inserts(&ctx).await;
    let taking = {
        let s = s.clone();
        tokio::spawn(async move { claim(&s, "relay-new", 10).await })
    };
    wait_waiting(&ctx, "INSERT", "outbox_events_lease", 1).await;
    let mut old_conn = held(&ctx).await;
    let completing = {
        let ctx_db = ctx.database.clone();
        let e = e.clone();
        let pool = ctx.pool.clone();
        tokio::spawn(async move {
            let ctx = common::Ctx {
                pool,
                database: ctx_db,
            };
            let applied = old_publish(&ctx, &mut old_conn, &e, old).await;
            old_conn.execute("COMMIT").await.unwrap();
            applied
        })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
    gaps.close().await.unwrap();
    let new = taking.await.unwrap();
    assert_eq!(ids(&new), vec![e.event_id]);
    assert!(new.records[0].maybe_sent_before);
    assert!(
        !completing.await.unwrap(),
        "the old relay applied its outcome"
    );
    let (status, token, leased, _, ack) = row(&ctx, &e).await;
    assert_eq!(
        (status.as_str(), token, leased, ack),
        ("pending", new.handle.token, true, None)
    );
    common::publish_all(&s, &new).await;
    assert_eq!(last_version(&ctx, "a").await, Some(2));
    ctx.drop().await;
}

/// Two heads of one aggregate in flight. A duplicate of version 1 whose transaction inserted
/// first (lower id) commits after the other copy was claimed: the head probe, ordered by
/// (version, id), now returns the late copy, which carries no token, so the aggregate does
/// not look leased and the late copy was handed out while the first was in flight (d10a114;
/// before it the lease was the aggregate's, in its state row). Now any live token at or below
/// the head's version makes the aggregate leased: the late copy waits, then is parked out of
/// order once the first is published. (Seen failing on d10a114, whose head probe read only
/// the head's own token.)
#[tokio::test]
async fn a_late_lower_id_duplicate_is_not_handed_out_beside_the_leased_head() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(30.0)).await;
    let (first, late) = (event("a", 1), event("a", 1));
    let mut tx = ctx.pool.begin().await.unwrap();
    s.append_many_in(&mut tx, std::slice::from_ref(&late))
        .await
        .unwrap();
    common::append(&ctx, &s, std::slice::from_ref(&first)).await;
    let one = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&one), vec![first.event_id]);
    tx.commit().await.unwrap();
    let two = claim(&s, "relay-2", 10).await;
    assert!(
        two.records.is_empty(),
        "handed out {:?} while version 1 of the aggregate is leased",
        ids(&two)
    );
    common::publish_all(&s, &one).await;
    let three = claim(&s, "relay-2", 10).await;
    assert!(three.records.is_empty());
    assert_eq!(
        status_of(&ctx, &late).await,
        ("parked".to_string(), Some("out_of_order".to_string()))
    );
    ctx.drop().await;
}

/// Version 2 handed out while version 1 is in flight. A parked duplicate of version 1 (the
/// copy that committed first, claimed and parked by its relay) and the other copy of version
/// 1 (lower id, committed later) leased; an operator discards the parked copy: the discard
/// raises the last version to 1, the leased row is no longer the head, version 2 is promoted
/// and the next claim handed it out beside the leased version 1 (d10a114; before it the
/// aggregate's state-row lease made the claim wait). Now the leased version 1 below the new
/// head keeps the aggregate leased. (Seen failing on d10a114.)
#[tokio::test]
async fn discarding_a_parked_duplicate_does_not_release_the_next_version_early() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(30.0)).await;
    let (copy, leased, v2) = (event("a", 1), event("a", 1), event("a", 2));
    park_a_copy_beside_its_uncommitted_twin(&ctx, &s, &copy, &leased).await;
    common::append(&ctx, &s, std::slice::from_ref(&v2)).await;
    let one = claim(&s, "relay-2", 10).await;
    assert_eq!(ids(&one), vec![leased.event_id]);
    s.discard_parked(copy.event_id, "ops", "a duplicate")
        .await
        .unwrap();
    let two = claim(&s, "relay-3", 10).await;
    assert!(
        two.records.is_empty(),
        "version 2 handed out while version 1 is leased: {:?}",
        ids(&two)
    );
    common::publish_all(&s, &one).await;
    let next = claim(&s, "relay-3", 10).await;
    assert_eq!(ids(&next), vec![v2.event_id]);
    ctx.drop().await;
}

/// A rolling upgrade: a claim of this version (token T1) ends; a relay of the previous
/// version takes the row over (its lease in the state row; the row keeps T1) and then retries
/// it (its completion ends the state-row lease and makes the row wait; it never touches
/// `claim_token`). Nothing names the row under another lease any more and the row still
/// carries T1; the stale claim of this version still completes nothing: the old relay
/// replaced the lease's end the claim wrote into `next_attempt_at`, which its completion
/// requires. Its release then leaves the row waiting for the old relay's retry.
#[tokio::test]
async fn a_claim_taken_over_by_an_old_relay_that_retried_completes_nothing() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(0.3)).await;
    let e = event("a", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let new = claim(&s, "relay-new", 10).await;
    assert_eq!(ids(&new), vec![e.event_id]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The old relay's takeover (its claim before migration 3).
    let old = Uuid::now_v7();
    sqlx::query(&format!(
        "UPDATE {a} s JOIN {e} e ON e.aggregate_key = s.aggregate_key \
         SET s.lease_owner = 'relay-old', s.lease_token = ?, \
             s.lease_until = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, s.lease_row = e.id, \
             e.next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND \
         WHERE e.event_id = ?",
        a = ctx.table("outbox_events_aggregate"),
        e = ctx.table("outbox_events"),
    ))
    .bind(old)
    .bind(e.event_id.as_uuid())
    .execute(&ctx.pool)
    .await
    .unwrap();
    // Its completion with a retry (before migration 3): the row waits, the lease ends.
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE {} SET attempts = attempts + 1, \
           next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, \
           last_error_class = 'transient', last_error_kind = 'other', last_error_message = 'x' \
         WHERE event_id = ? AND status = 'pending'",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(&format!(
        "UPDATE {} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
           lease_row = NULL WHERE aggregate_id = 'a'",
        ctx.table("outbox_events_aggregate")
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let rep = s.complete(&new.handle, &[published(&e, 1)]).await.unwrap();
    assert_eq!(
        rep.applied, 0,
        "the claim taken over by the old relay completed: {rep:?}"
    );
    let (status, token, waiting, ..) = row(&ctx, &e).await;
    assert_eq!((status.as_str(), waiting), ("pending", true));
    s.release(&new.handle).await.unwrap();
    assert_eq!(
        row(&ctx, &e).await.1,
        token,
        "the release ended the old relay's retry wait"
    );
    assert!(row(&ctx, &e).await.2, "the release made the row due again");
    ctx.drop().await;
}
