//! Lease mode with the lease on the claimed event row (migration 3): the claim's token in the
//! row's `claim_token`, one `<table>_lease` row per batch (owner, expiry). Fencing through the
//! token after a takeover, a stale completion that marks nothing, the release by owner, the
//! cleanup of lease rows left by relays that stopped, and a rolling upgrade beside a relay of
//! the previous version (which kept its lease in the aggregate's state row).
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::ClaimedBatch;
use uuid::Uuid;

use common::{claim, event, lease, park, published, retry, versions};

/// (status, claim token, `next_attempt_at` in the future, `maybe_delivered`, ack position) of
/// the row of `agg` version `v`.
async fn row(ctx: &common::Ctx, agg: &str, v: i64) -> (String, Uuid, bool, bool, Option<i64>) {
    sqlx::query_as(&format!(
        "SELECT CAST(status AS CHAR), claim_token, next_attempt_at > UTC_TIMESTAMP(6), \
                maybe_delivered = 1, ack_position \
         FROM {} WHERE aggregate_id = ? AND aggregate_version = ?",
        ctx.table("outbox_events")
    ))
    .bind(agg)
    .bind(v)
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

/// The lease rows: (token, owner), by token.
async fn lease_rows(ctx: &common::Ctx) -> Vec<(Uuid, String)> {
    sqlx::query_as(&format!(
        "SELECT token, CAST(owner AS CHAR) FROM {} ORDER BY token",
        ctx.table("outbox_events_lease")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
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

use outbox_mysql::MySqlOutboxStore;

/// A relay whose lease ended and was taken over completes nothing: its publication is
/// superseded, the row keeps the new claim's token and stays pending (no acknowledgement, no
/// last version), and the new claim's publication applies. (Seen failing with the token check
/// removed from the marking's `WHERE`: the stale completion marked the row published.)
#[tokio::test]
async fn a_completion_after_a_takeover_marks_nothing() {
    let ctx = ctx!(4);
    let s = ctx.store(lease(0.3)).await;
    let e = event("a", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let old = claim(&s, "relay-1", 10).await;
    assert_eq!(versions(&old), vec![("a".to_string(), 1)]);
    assert_eq!(row(&ctx, "a", 1).await.1, old.handle.token);
    let new = claim_after_expiry(&s, "relay-2").await;
    assert_eq!(versions(&new), vec![("a".to_string(), 1)]);
    assert!(
        new.records[0].maybe_sent_before,
        "the old lease ended without an outcome"
    );
    assert_eq!(row(&ctx, "a", 1).await.1, new.handle.token, "taken over");
    let rep = s.complete(&old.handle, &[published(&e, 7)]).await.unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    assert_eq!(rep.superseded_events, vec![e.event_id]);
    let (status, token, leased, maybe, ack) = row(&ctx, "a", 1).await;
    assert_eq!(
        (status.as_str(), token, leased, maybe, ack),
        ("pending", new.handle.token, true, true, None),
        "the stale completion changed the row"
    );
    assert_eq!(last_version(&ctx, "a").await, None);
    let rep = s.complete(&new.handle, &[published(&e, 8)]).await.unwrap();
    assert_eq!(rep.applied, 1);
    assert_eq!(row(&ctx, "a", 1).await.4, Some(8));
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    ctx.drop().await;
}

/// Retries and parks are fenced by the token too: after a takeover the old relay's retry and
/// park change nothing, and its release does not make the new claim's row due. (Seen failing
/// with the token check removed from the retry and park statements: the row got the old
/// relay's retry, its token cleared.)
#[tokio::test]
async fn retries_parks_and_releases_after_a_takeover_change_nothing() {
    let ctx = ctx!(4);
    let s = ctx.store(lease(0.3)).await;
    let (a, b) = (event("a", 1), event("b", 1));
    common::append(&ctx, &s, &[a.clone(), b.clone()]).await;
    let old = claim(&s, "relay-1", 10).await;
    assert_eq!(old.records.len(), 2);
    let new = claim_after_expiry(&s, "relay-2").await;
    assert_eq!(new.records.len(), 2);
    let rep = s
        .complete(&old.handle, &[retry(&a, Duration::from_secs(60)), park(&b)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    s.release(&old.handle).await.unwrap();
    for agg in ["a", "b"] {
        let (status, token, leased, ..) = row(&ctx, agg, 1).await;
        assert_eq!(
            (status.as_str(), token, leased),
            ("pending", new.handle.token, true),
            "{agg}"
        );
    }
    // The new claim's own outcomes apply, and end its claim of the rows.
    let rep = s
        .complete(&new.handle, &[retry(&a, Duration::from_secs(60)), park(&b)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 2);
    assert_eq!(
        row(&ctx, "a", 1).await.1,
        Uuid::nil(),
        "a retried row keeps no token"
    );
    assert_eq!(row(&ctx, "b", 1).await.0, "parked");
    assert!(
        lease_rows(&ctx).await.is_empty(),
        "the batch's lease row is deleted"
    );
    ctx.drop().await;
}

/// `release_claims_of` ends the live claims of one owner only: its rows are due again without
/// the token (its completion then applies nothing), its lease rows are gone, the other
/// relay's claim is untouched; each released row is audited. (Seen failing with the release
/// matching every owner: relay-2's row was released too.)
#[tokio::test]
async fn release_by_owner_ends_that_relays_claims_only() {
    let ctx = ctx!(4);
    let s = ctx.store(lease(30.0)).await;
    let (a, b, c) = (event("a", 1), event("b", 1), event("c", 1));
    common::append(&ctx, &s, &[a.clone(), b.clone()]).await;
    let one = claim(&s, "relay-1", 10).await;
    assert_eq!(one.records.len(), 2);
    common::append(&ctx, &s, std::slice::from_ref(&c)).await;
    let two = claim(&s, "relay-2", 10).await;
    assert_eq!(versions(&two), vec![("c".to_string(), 1)]);
    assert_eq!(lease_rows(&ctx).await.len(), 2);
    // Byte for byte: "relay-1 " is another relay.
    assert_eq!(s.release_claims_of("relay-1 ", "ops").await.unwrap(), 0);
    assert_eq!(s.release_claims_of("relay-1", "ops").await.unwrap(), 2);
    for agg in ["a", "b"] {
        let (status, token, leased, ..) = row(&ctx, agg, 1).await;
        assert_eq!(
            (status.as_str(), token, leased),
            ("pending", Uuid::nil(), false)
        );
    }
    let (_, token, leased, ..) = row(&ctx, "c", 1).await;
    assert_eq!(
        (token, leased),
        (two.handle.token, true),
        "relay-2's claim kept"
    );
    assert_eq!(
        lease_rows(&ctx).await,
        vec![(two.handle.token, "relay-2".to_string())]
    );
    let audit = s.audit_trail(None).await.unwrap();
    assert_eq!(audit.len(), 2, "{audit:?}");
    // The released relay's late completion applies nothing.
    let rep = s.complete(&one.handle, &[published(&a, 1)]).await.unwrap();
    assert_eq!(rep.applied, 0);
    // Its rows are claimable again at once.
    let again = claim(&s, "relay-3", 10).await;
    assert_eq!(
        versions(&again),
        vec![("a".to_string(), 1), ("b".to_string(), 1)]
    );
    ctx.drop().await;
}

/// Cleanup deletes the lease rows of expired claims (a relay that stopped without completing
/// or releasing), and keeps the live ones; the stopped relay's rows are taken over as before.
/// (Seen failing with the lease-row cleanup removed: the expired row stayed.)
#[tokio::test]
async fn cleanup_removes_lease_rows_of_expired_claims() {
    let ctx = ctx!(4);
    let short = ctx.store(lease(0.3)).await;
    let long = ctx.builder(lease(30.0)).build().unwrap();
    common::append(&ctx, &short, &[event("a", 1)]).await;
    let gone = claim(&short, "relay-gone", 10).await;
    assert_eq!(gone.records.len(), 1);
    common::append(&ctx, &short, &[event("b", 1)]).await;
    let live = claim(&long, "relay-live", 10).await;
    assert_eq!(versions(&live), vec![("b".to_string(), 1)]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(lease_rows(&ctx).await.len(), 2);
    short.cleanup(Duration::from_secs(3600), 100).await.unwrap();
    assert_eq!(
        lease_rows(&ctx).await,
        vec![(live.handle.token, "relay-live".to_string())]
    );
    let taken = claim_after_expiry(&short, "relay-next").await;
    assert_eq!(versions(&taken), vec![("a".to_string(), 1)]);
    assert!(taken.records[0].maybe_sent_before);
    ctx.drop().await;
}

/// Writes the lease a relay of the previous version writes at claim: the lease in the
/// aggregate's state row (owner, token, expiry, the row) and the row's `next_attempt_at` at the
/// expiry. Returns the token.
async fn old_style_lease(ctx: &common::Ctx, agg: &str, v: i64, owner: &str, secs: f64) -> Uuid {
    let token = Uuid::now_v7();
    let us = (secs * 1e6) as i64;
    sqlx::query(&format!(
        "UPDATE {a} s JOIN {e} e ON e.aggregate_key = s.aggregate_key \
         SET s.lease_owner = ?, s.lease_token = ?, \
             s.lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, s.lease_row = e.id, \
             e.next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
         WHERE e.aggregate_id = ? AND e.aggregate_version = ?",
        a = ctx.table("outbox_events_aggregate"),
        e = ctx.table("outbox_events"),
    ))
    .bind(owner)
    .bind(token)
    .bind(us)
    .bind(us)
    .bind(agg)
    .bind(v)
    .execute(&ctx.pool)
    .await
    .unwrap();
    token
}

/// The state row's lease token (the previous version's lease).
async fn state_lease(ctx: &common::Ctx, agg: &str) -> Option<Uuid> {
    sqlx::query_scalar(&format!(
        "SELECT lease_token FROM {} WHERE aggregate_id = ?",
        ctx.table("outbox_events_aggregate")
    ))
    .bind(agg)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A rolling upgrade: an in-flight lease of a relay of the previous version (in the state
/// row) is respected while live (no claim hands its head out, though the row carries no token)
/// and, once expired, taken over by a claim of this version, which clears it (the old relay's
/// completion checks its token there) and marks the row as maybe sent. (Seen failing with
/// the state-row lease no longer read as "leased": the live head was handed out; and with the
/// takeover not clearing it: the old token stayed.)
#[tokio::test]
async fn an_old_relays_lease_is_respected_then_taken_over_and_fenced() {
    let ctx = ctx!(4);
    let s = ctx.store(lease(30.0)).await;
    // The aggregate met before (its state row exists), then v2 leased by an old relay.
    common::append(&ctx, &s, &[event("a", 1)]).await;
    common::publish_all(&s, &claim(&s, "relay", 10).await).await;
    common::append(&ctx, &s, &[event("a", 2), event("b", 1)]).await;
    let b = claim(&s, "relay", 1).await;
    assert_eq!(versions(&b), vec![("a".to_string(), 2)]);
    s.release(&b.handle).await.unwrap();
    let old = old_style_lease(&ctx, "a", 2, "relay-old", 0.5).await;
    // A due row under a live old-style lease is not handed out (the head is leased).
    sqlx::query(&format!(
        "UPDATE {} SET next_attempt_at = UTC_TIMESTAMP(6) WHERE aggregate_id = 'a'",
        ctx.table("outbox_events")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let batch = claim(&s, "relay-new", 10).await;
    assert_eq!(versions(&batch), vec![("b".to_string(), 1)]);
    common::publish_all(&s, &batch).await;
    assert_eq!(state_lease(&ctx, "a").await, Some(old));
    tokio::time::sleep(Duration::from_millis(600)).await;
    let taken = claim_after_expiry(&s, "relay-new").await;
    assert_eq!(versions(&taken), vec![("a".to_string(), 2)]);
    assert!(
        taken.records[0].maybe_sent_before,
        "the old lease ended without an outcome"
    );
    assert_eq!(
        state_lease(&ctx, "a").await,
        None,
        "the old relay is fenced"
    );
    common::publish_all(&s, &taken).await;
    assert_eq!(last_version(&ctx, "a").await, Some(2));
    ctx.drop().await;
}

/// A rolling upgrade, the other way: a relay of the previous version takes over an expired
/// claim of this version (its lease in the state row; the row keeps the new claim's token).
/// The claim of this version then completes nothing (its publication superseded, the row
/// untouched), and its release leaves the old relay's row waiting for its lease;
/// `release_claims_of` ends the old relay's live lease. (Seen failing with the completion not
/// excluding rows named by a state-row lease: the stale publication applied.)
#[tokio::test]
async fn a_claim_taken_over_by_an_old_relay_completes_nothing() {
    let ctx = ctx!(4);
    let s = ctx.store(lease(0.3)).await;
    let e = event("a", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let new = claim(&s, "relay-new", 10).await;
    assert_eq!(new.records.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    old_style_lease(&ctx, "a", 1, "relay-old", 30.0).await;
    let rep = s.complete(&new.handle, &[published(&e, 1)]).await.unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    s.release(&new.handle).await.unwrap();
    let (status, _, leased, _, ack) = row(&ctx, "a", 1).await;
    assert_eq!((status.as_str(), leased, ack), ("pending", true, None));
    assert!(claim(&s, "relay-new", 10).await.records.is_empty());
    assert_eq!(s.release_claims_of("relay-old", "ops").await.unwrap(), 1);
    assert_eq!(state_lease(&ctx, "a").await, None);
    let again = claim(&s, "relay-new", 10).await;
    assert_eq!(versions(&again), vec![("a".to_string(), 1)]);
    common::publish_all(&s, &again).await;
    ctx.drop().await;
}
