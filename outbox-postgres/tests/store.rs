//! Integration tests of the PostgreSQL stores beyond the conformance suite: atomicity,
//! validation, identifiers, both claim modes, fencing, lease expiry, blocking and unblocking,
//! operator actions, cleanup, stats, the inbox and the LISTEN/NOTIFY wake-up.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::InboxStoreExt;
use outbox_core::{
    ClaimMode, ClaimRequest, Envelope, ErrorClass, EventId, InboxStore, LastError, OperatorAction,
    Outcome, ParkKind, Payload, Registration, StoreError, StoreErrorKind,
};
use outbox_postgres::{AppendGuard, PostgresInboxStore, PostgresOutboxStore};
use sqlx::Row;

use common::{claim, event, lease, park, publish_all, published, versions};

async fn count(ctx: &common::Ctx, filter: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events WHERE {filter}",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// Leases recorded in the lease table (one row per aggregate in flight in lease mode).
async fn leases(ctx: &common::Ctx) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events_aggregate WHERE lease_token IS NOT NULL",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn rolled_back_append_leaves_nothing_and_commit_keeps_all() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let mut tx = ctx.pool.begin().await.unwrap();
    store
        .append_many(&mut *tx, &[event("a", 1), event("a", 2)])
        .await
        .unwrap();
    // The trait method joins the same transaction.
    AppendStore::append(&store, &mut tx, &[event("b", 1)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(count(&ctx, "true").await, 0);
    assert!(claim(&store, "r", 10).await.is_empty());

    let mut tx = ctx.pool.begin().await.unwrap();
    store.append(&mut *tx, &event("a", 1)).await.unwrap();
    AppendStore::append(&store, &mut tx, &[event("b", 1), event("c", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Also through the pool directly (autocommit).
    store.append(&ctx.pool, &event("d", 1)).await.unwrap();
    assert_eq!(count(&ctx, "status = 'pending'").await, 4);

    // The envelope round-trips exactly.
    let e = Envelope::builder("order", "rt", 1, "order.created")
        .payload(Payload::new(
            "application/octet-stream",
            vec![0u8, 1, 2, 255],
        ))
        .schema_version(7)
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("x-tenant", "t1")
        .build()
        .unwrap();
    store.append(&ctx.pool, &e).await.unwrap();
    let batch = claim(&store, "r", 10).await;
    let got = batch
        .records
        .iter()
        .find(|r| r.envelope.event_id == e.event_id)
        .expect("claimed");
    assert_eq!(got.envelope, e);
    ctx.drop().await;
}

#[tokio::test]
async fn invalid_events_and_duplicates_write_nothing() {
    let ctx = ctx!(4);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .limits(outbox_core::EnvelopeLimits::default().with_max_payload_bytes(10))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let big = Envelope::builder("order", "a", 1, "t")
        .payload(Payload::new("application/octet-stream", vec![0u8; 11]))
        .build()
        .unwrap();
    let mut tx = ctx.pool.begin().await.unwrap();
    let err = store
        .append_many(&mut *tx, &[event("ok", 1), big])
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Validation);
    assert_eq!(err.class, ErrorClass::Permanent);
    tx.commit().await.unwrap();
    assert_eq!(
        count(&ctx, "true").await,
        0,
        "the valid event was not written either"
    );

    // An envelope altered after building is checked again.
    let mut bad = event("a", 1);
    bad.event_type = String::new();
    let err = store.append(&ctx.pool, &bad).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Validation);

    let e = event("a", 1);
    store.append(&ctx.pool, &e).await.unwrap();
    let err = store.append(&ctx.pool, &e).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Constraint);
    assert_eq!(count(&ctx, "true").await, 1);
    ctx.drop().await;
}

#[tokio::test]
async fn hostile_identifiers_are_configuration_errors() {
    let Some(pool) = common::pool(2).await else {
        return;
    };
    let hostile = [
        "x\"; DROP TABLE users; --",
        "outbox.events",
        "Outbox",
        "",
        "a b",
        "pg_toast",
        "o'brien",
    ];
    for name in hostile {
        let e = PostgresOutboxStore::builder(pool.clone())
            .schema(name)
            .build()
            .unwrap_err();
        assert_eq!(e.kind, StoreErrorKind::Configuration, "schema {name:?}");
        let e = PostgresOutboxStore::builder(pool.clone())
            .table(name)
            .build()
            .unwrap_err();
        assert_eq!(e.kind, StoreErrorKind::Configuration, "table {name:?}");
        let e = PostgresOutboxStore::builder(pool.clone())
            .notify_channel(Some(name))
            .build()
            .unwrap_err();
        assert_eq!(e.kind, StoreErrorKind::Configuration, "channel {name:?}");
        let e = PostgresInboxStore::builder(pool.clone())
            .table(name)
            .build()
            .unwrap_err();
        assert_eq!(e.kind, StoreErrorKind::Configuration, "inbox {name:?}");
        assert!(outbox_postgres::outbox_schema_sql(name, "t").is_err());
    }
    let e = PostgresOutboxStore::builder(pool.clone())
        .table("a".repeat(41))
        .build()
        .unwrap_err();
    assert_eq!(e.kind, StoreErrorKind::Configuration);
    let e = PostgresOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::Lease {
            duration: Duration::ZERO,
        })
        .build()
        .unwrap_err();
    assert_eq!(e.kind, StoreErrorKind::Configuration);
    // A lease that does not outlive the publisher's delivery timeout is rejected.
    let e = PostgresOutboxStore::builder(pool.clone())
        .claim_mode(lease(5.0))
        .publisher_delivery_timeout(Duration::from_secs(30))
        .build()
        .unwrap_err();
    assert_eq!(e.kind, StoreErrorKind::Configuration);
    assert!(e.message.contains("delivery timeout"), "{e}");
    let e = PostgresOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::LockedTransaction)
        .locked_max_hold(Duration::from_secs(10))
        .publisher_delivery_timeout(Duration::from_secs(30))
        .build()
        .unwrap_err();
    assert_eq!(e.kind, StoreErrorKind::Configuration);
    assert!(PostgresOutboxStore::builder(pool.clone())
        .claim_mode(lease(60.0))
        .publisher_delivery_timeout(Duration::from_secs(30))
        .build()
        .is_ok());
    // Custom valid names work end to end.
    let schema = common::schema_name();
    let store = PostgresOutboxStore::builder(pool.clone())
        .schema(&schema)
        .table("shop_outbox")
        .build()
        .unwrap();
    assert_eq!(store.migrate().await.unwrap(), 11);
    assert_eq!(
        store.migrate().await.unwrap(),
        0,
        "migrations are applied once"
    );
    store.append(&pool, &event("a", 1)).await.unwrap();
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".shop_outbox"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn missing_schema_is_a_schema_error() {
    let ctx = ctx!(2);
    let store = ctx.store_unmigrated(lease(30.0));
    let err = store.append(&ctx.pool, &event("a", 1)).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Schema, "{err}");
    let err = store.claim(&ClaimRequest::new("r", 1)).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Schema);
}

#[derive(Debug)]
struct RefuseNonCritical;

impl AppendGuard for RefuseNonCritical {
    fn check(&self, events: &[Envelope]) -> Result<(), StoreError> {
        if events
            .iter()
            .any(|e| e.headers.get("x-critical").map(String::as_str) != Some("1"))
        {
            return Err(StoreError::new(
                StoreErrorKind::Backpressure,
                "backlog above threshold",
            ));
        }
        Ok(())
    }
}

#[tokio::test]
async fn append_guard_refuses_before_writing() {
    let ctx = ctx!(2);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .append_guard(Arc::new(RefuseNonCritical))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let err = store.append(&ctx.pool, &event("a", 1)).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Backpressure);
    assert_eq!(err.class, ErrorClass::Transient);
    let critical = Envelope::builder("order", "a", 1, "t")
        .header("x-critical", "1")
        .build()
        .unwrap();
    store.append(&ctx.pool, &critical).await.unwrap();
    assert_eq!(count(&ctx, "true").await, 1);
    ctx.drop().await;
}

#[tokio::test]
async fn lease_claim_records_owner_token_expiry_and_ack_metadata() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let (a1, a2, b1) = (event("a", 1), event("a", 2), event("b", 1));
    store
        .append_many(&ctx.pool, &[a1.clone(), a2.clone(), b1.clone()])
        .await
        .unwrap();
    let batch = claim(&store, "relay-1", 10).await;
    assert_eq!(versions(&batch), vec![("a".into(), 1), ("b".into(), 1)]);
    let left = batch.lease_remaining.expect("lease mode reports the lease");
    assert!(left > Duration::from_secs(29) && left <= Duration::from_secs(30));
    let row = sqlx::query(&format!(
        "SELECT l.lease_owner, l.lease_token, l.lease_until > now() AS live \
         FROM \"{0}\".outbox_events e JOIN \"{0}\".outbox_events_aggregate l ON l.lease_row = e.id \
         WHERE e.event_id = $1",
        ctx.schema
    ))
    .bind(a1.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>("lease_owner"), "relay-1");
    assert_eq!(row.get::<uuid::Uuid, _>("lease_token"), batch.handle.token);
    assert!(row.get::<bool, _>("live"));
    // A second relay gets nothing: both heads are leased, a2 is behind a1.
    assert!(claim(&store, "relay-2", 10).await.is_empty());
    let rep = store
        .complete(&batch.handle, &[published(&a1, 41), published(&b1, 42)])
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.superseded), (2, 0));
    let row = sqlx::query(&format!(
        "SELECT status, ack_transport, ack_destination, ack_partition, ack_position, published_at IS NOT NULL AS p, \
                NOT EXISTS (SELECT 1 FROM \"{0}\".outbox_events_aggregate l \
                            WHERE l.lease_row = e.id AND l.lease_token IS NOT NULL) AS cleared \
         FROM \"{0}\".outbox_events e WHERE event_id = $1",
        ctx.schema
    ))
    .bind(a1.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>("status"), "published");
    assert_eq!(row.get::<String, _>("ack_transport"), "kafka");
    assert_eq!(row.get::<String, _>("ack_destination"), "orders");
    assert_eq!(row.get::<i32, _>("ack_partition"), 3);
    assert_eq!(row.get::<i64, _>("ack_position"), 41);
    assert!(row.get::<bool, _>("p") && row.get::<bool, _>("cleared"));
    let next = claim(&store, "relay-2", 10).await;
    assert_eq!(versions(&next), vec![("a".into(), 2)]);
    ctx.drop().await;
}

#[tokio::test]
async fn expired_lease_is_reclaimed_and_the_stale_holder_is_fenced() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(1.0)).await;
    let a1 = event("a", 1);
    store.append(&ctx.pool, &a1).await.unwrap();
    let first = claim(&store, "slow", 10).await;
    assert_eq!(first.records.len(), 1);
    assert!(claim(&store, "other", 10).await.is_empty(), "live lease");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let second = claim(&store, "fast", 10).await;
    assert_eq!(second.records.len(), 1, "expired lease returns the row");
    assert_eq!(second.records[0].attempts, 0, "expiry is not an attempt");
    assert_ne!(first.handle.token, second.handle.token);
    // The stale holder's outcome is refused and counted.
    let rep = store
        .complete(&first.handle, &[published(&a1, 1)])
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.superseded), (0, 1));
    assert_eq!(count(&ctx, "status = 'published'").await, 0);
    // Its release is a no-op for rows it no longer owns.
    store.release(&first.handle).await.unwrap();
    let rep = store
        .complete(&second.handle, &[published(&a1, 2)])
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.superseded), (1, 0));
    let off: i64 = sqlx::query_scalar(&format!(
        "SELECT ack_position FROM \"{}\".outbox_events",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(off, 2);
    ctx.drop().await;
}

#[tokio::test]
async fn a_claim_that_ended_without_outcome_marks_the_next_claim_as_a_possible_resend() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(1.0)).await;
    store
        .append_many(&ctx.pool, &[event("a", 1), event("b", 1), event("c", 1)])
        .await
        .unwrap();
    let first = claim(&store, "crashed", 10).await;
    assert_eq!(first.records.len(), 3);
    assert!(
        first
            .records
            .iter()
            .all(|r| !r.maybe_sent_before && !r.is_resend()),
        "a first claim sends nothing twice"
    );
    // The relay dies after sending (or its completion is lost): its leases expire.
    drop(first);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let second = claim(&store, "next", 10).await;
    let mut seen: Vec<(String, bool)> = second
        .records
        .iter()
        .map(|r| (r.envelope.aggregate_id.clone(), r.maybe_sent_before))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![("a".into(), true), ("b".into(), true), ("c".into(), true)],
        "every row of the abandoned claim may have been sent"
    );
    assert!(second
        .records
        .iter()
        .all(|r| r.attempts == 0 && r.is_resend()));
    // That is kept with the row: a claim released in between does not make the next send a
    // first one.
    store.release(&second.handle).await.unwrap();
    let third = claim(&store, "after-release", 10).await;
    assert_eq!(third.records.len(), 3);
    assert!(third.records.iter().all(|r| r.maybe_sent_before));
    publish_all(&store, &third).await;
    // A claim released without sending is not a possible re-send, nor is the next version of
    // a published aggregate.
    store
        .append_many(&ctx.pool, &[event("a", 2), event("d", 1)])
        .await
        .unwrap();
    let fourth = claim(&store, "later", 10).await;
    assert_eq!(versions(&fourth), vec![("a".into(), 2), ("d".into(), 1)]);
    store.release(&fourth.handle).await.unwrap();
    let fifth = claim(&store, "later", 10).await;
    assert_eq!(fifth.records.len(), 2);
    assert!(fifth.records.iter().all(|r| !r.maybe_sent_before));
    ctx.drop().await;
}

#[tokio::test]
async fn completion_from_another_store_instance_is_fenced_by_token() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let other = ctx.store(lease(30.0)).await;
    let (a1, b1) = (event("a", 1), event("b", 1));
    store
        .append_many(&ctx.pool, &[a1.clone(), b1.clone()])
        .await
        .unwrap();
    let batch = claim(&store, "r", 10).await;
    // `other` has no memory of the claim: it finds the rows by token; b1 has no outcome and
    // is released.
    let rep = other
        .complete(&batch.handle, &[published(&a1, 1)])
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.superseded), (1, 0));
    assert_eq!(leases(&ctx).await, 0);
    let again = claim(&other, "r2", 10).await;
    assert_eq!(versions(&again), vec![("b".into(), 1)]);
    ctx.drop().await;
}

#[tokio::test]
async fn locked_claim_holds_rows_until_completed_or_released() {
    let ctx = ctx!(8);
    let store = ctx.store(ClaimMode::LockedTransaction).await;
    let relay2 = ctx.store(ClaimMode::LockedTransaction).await;
    let (a1, a2, b1) = (event("a", 1), event("a", 2), event("b", 1));
    store
        .append_many(&ctx.pool, &[a1.clone(), a2.clone(), b1.clone()])
        .await
        .unwrap();
    let batch = claim(&store, "r1", 10).await;
    assert_eq!(versions(&batch), vec![("a".into(), 1), ("b".into(), 1)]);
    assert_eq!(batch.lease_remaining, None);
    assert_eq!(store.stats().await.unwrap().in_flight, 2);
    // Another relay (another connection) sees nothing claimable: the heads are locked and a2
    // is behind a1.
    assert!(claim(&relay2, "r2", 10).await.is_empty());
    // Nothing is written to the rows while the claim is open.
    assert_eq!(leases(&ctx).await, 0);
    let rep = store
        .complete(&batch.handle, &[published(&a1, 7)])
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.superseded), (1, 0));
    // b1 had no outcome: released unchanged.
    let next = claim(&relay2, "r2", 10).await;
    assert_eq!(versions(&next), vec![("a".into(), 2), ("b".into(), 1)]);
    store.release(&next.handle).await.unwrap(); // not this store's claim: no-op
    relay2.release(&next.handle).await.unwrap();
    let last = claim(&store, "r1", 10).await;
    assert_eq!(last.records.len(), 2);
    assert_eq!(
        last.records[0].attempts, 0,
        "release does not count an attempt"
    );
    // Completing an unknown (already finished) claim refuses every outcome.
    let rep = store
        .complete(&batch.handle, &[published(&a2, 1)])
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.superseded), (0, 1));
    publish_all(&store, &last).await;
    assert_eq!(count(&ctx, "status = 'published'").await, 3);
    ctx.drop().await;
}

#[tokio::test]
async fn retry_delay_runs_on_the_database_clock() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let a1 = event("a", 1);
    store.append(&ctx.pool, &a1).await.unwrap();
    let batch = claim(&store, "r", 10).await;
    let retry = Outcome::Retry {
        event_id: a1.event_id,
        delay: Duration::from_millis(700),
        error: LastError {
            class: ErrorClass::Transient,
            kind: "timeout".into(),
            message: "no ack".into(),
        },
    };
    store.complete(&batch.handle, &[retry]).await.unwrap();
    assert!(
        claim(&store, "r", 10).await.is_empty(),
        "not before the delay"
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    let again = claim(&store, "r", 10).await;
    assert_eq!(again.records.len(), 1);
    assert_eq!(again.records[0].attempts, 1);
    let kind: String = sqlx::query_scalar(&format!(
        "SELECT last_error_kind FROM \"{}\".outbox_events",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(kind, "timeout");
    ctx.drop().await;
}

/// Rows queued behind a head are blocked (out of the claim index) and unblocked when the head
/// is published or discarded; rows that commit late are never skipped.
#[tokio::test]
async fn blocking_unblocking_and_late_commits() {
    let ctx = ctx!(6);
    let store = ctx.store(lease(30.0)).await;
    let evs: Vec<_> = (1..=5).map(|v| event("deep", v)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    // A transaction that appends the next version and commits late.
    let mut late = ctx.pool.begin().await.unwrap();
    let v6 = event("deep", 6);
    store.append(&mut *late, &v6).await.unwrap();
    let other = event("other", 1);
    store.append(&ctx.pool, &other).await.unwrap();

    let b = claim(&store, "r", 100).await;
    assert_eq!(versions(&b), vec![("deep".into(), 1), ("other".into(), 1)]);
    assert_eq!(
        count(&ctx, "blocked").await,
        4,
        "v2..v5 classified as blocked"
    );
    late.commit().await.unwrap();
    publish_all(&store, &b).await;
    assert_eq!(count(&ctx, "blocked").await, 3, "v2 unblocked");
    for v in 2..=6 {
        let b = claim(&store, "r", 100).await;
        assert_eq!(versions(&b), vec![("deep".into(), v)], "version {v}");
        publish_all(&store, &b).await;
    }
    assert!(claim(&store, "r", 100).await.is_empty());
    assert_eq!(count(&ctx, "status = 'published'").await, 7);
    ctx.drop().await;
}

#[tokio::test]
async fn parking_blocks_the_aggregate_and_operator_actions_are_audited() {
    let ctx = ctx!(6);
    let store = ctx.store(ClaimMode::LockedTransaction).await;
    let evs: Vec<_> = (1..=3).map(|v| event("p", v)).collect();
    let free = event("free", 1);
    store.append_many(&ctx.pool, &evs).await.unwrap();
    store.append(&ctx.pool, &free).await.unwrap();
    let b = claim(&store, "r", 10).await;
    let outs = vec![park(&evs[0]), published(&free, 1)];
    assert_eq!(store.complete(&b.handle, &outs).await.unwrap().applied, 2);
    assert!(
        claim(&store, "r", 10).await.is_empty(),
        "aggregate p is blocked"
    );
    let parked = store.list_parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].envelope, evs[0]);
    assert_eq!(parked[0].reason.kind, ParkKind::PermanentError);
    assert_eq!(parked[0].reason.error.kind, "record_too_large");
    assert_eq!(parked[0].attempts, 1);

    // Operator actions on something not parked.
    let err = store
        .retry_parked(evs[1].event_id, "ops")
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::NotFound);
    let err = store
        .retry_parked(EventId::now_v7(), "ops")
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::NotFound);
    let err = store
        .discard_parked(evs[0].event_id, "ops", "  ")
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Validation);

    // Re-issue: a copy with a new id at the same version goes first.
    let new_id = store
        .reissue_parked(evs[0].event_id, "alice", "payload fixed upstream")
        .await
        .unwrap();
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    assert_eq!(b.records[0].envelope.event_id, new_id);
    assert_eq!(b.records[0].envelope.aggregate_version, 1);
    assert_eq!(b.records[0].envelope.payload, evs[0].payload);
    // Park v2 now, then discard it: v3 flows.
    publish_all(&store, &b).await;
    let b = claim(&store, "r", 10).await;
    store.complete(&b.handle, &[park(&evs[1])]).await.unwrap();
    store
        .discard_parked(evs[1].event_id, "bob", "obsolete")
        .await
        .unwrap();
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("p".into(), 3)]);
    store.complete(&b.handle, &[park(&evs[2])]).await.unwrap();
    store.retry_parked(evs[2].event_id, "carol").await.unwrap();
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("p".into(), 3)]);
    assert_eq!(b.records[0].attempts, 0, "retry resets attempts");
    publish_all(&store, &b).await;

    let trail = store.audit_trail(None).await.unwrap();
    let actions: Vec<_> = trail.iter().map(|a| (a.action, a.actor.as_str())).collect();
    assert_eq!(
        actions,
        vec![
            (OperatorAction::Reissue, "alice"),
            (OperatorAction::Discard, "bob"),
            (OperatorAction::Retry, "carol"),
        ]
    );
    assert_eq!(trail[0].new_event_id, Some(new_id));
    assert_eq!(trail[1].reason, "obsolete");
    let one = store.audit_trail(Some(evs[1].event_id)).await.unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(store.stats().await.unwrap().parked, 0);
    ctx.drop().await;
}

#[tokio::test]
async fn cleanup_in_bounded_batches_with_archive() {
    let ctx = ctx!(4);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .archive(true)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let evs: Vec<_> = (0..10).map(|i| event(&format!("c{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let pending = event("pending", 1);
    let parked_ev = event("parked", 1);
    let b = claim(&store, "r", 100).await;
    publish_all(&store, &b).await;
    store
        .append_many(&ctx.pool, &[pending.clone(), parked_ev.clone()])
        .await
        .unwrap();
    let b = claim(&store, "r", 100).await;
    store
        .complete(&b.handle, &[park(&parked_ev)])
        .await
        .unwrap();

    let state_rows = || async {
        sqlx::query_scalar::<_, i64>(&format!(
            "SELECT count(*) FROM \"{}\".outbox_events_aggregate WHERE last_version >= 1",
            ctx.schema
        ))
        .fetch_one(&ctx.pool)
        .await
        .unwrap()
    };
    let rep = store.cleanup(Duration::from_secs(3600), 3).await.unwrap();
    assert_eq!(rep.removed, 0, "nothing past retention yet");
    assert_eq!(
        state_rows().await,
        10,
        "one state row per published aggregate"
    );
    assert_eq!(leases(&ctx).await, 0, "no lease is live");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rep = store.cleanup(Duration::from_millis(100), 3).await.unwrap();
    assert_eq!(rep.removed, 10);
    assert_eq!(rep.batches, 4, "3 + 3 + 3 + 1");
    assert_eq!(count(&ctx, "true").await, 2, "pending and parked rows stay");
    assert_eq!(
        state_rows().await,
        10,
        "the per-aggregate last version survives cleanup of the rows"
    );
    // A late duplicate of a cleaned-up version is still recognised as out of order.
    let late = event("c3", 1);
    store.append(&ctx.pool, &late).await.unwrap();
    let b = claim(&store, "r", 100).await;
    assert!(b
        .records
        .iter()
        .all(|r| r.envelope.event_id != late.event_id));
    assert_eq!(b.parked.len(), 1);
    assert_eq!(b.parked[0].kind, ParkKind::OutOfOrder);
    let archived: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events_archive WHERE status = 'published' \
         AND ack_destination = 'orders'",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(archived, 10);
    ctx.drop().await;
}

#[tokio::test]
async fn stats_report_backlog_ages_and_table_figures() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let empty = store.stats().await.unwrap();
    assert_eq!(empty.unpublished, 0);
    assert_eq!(empty.oldest_claimable_age, None);
    let evs: Vec<_> = (1..=3).map(|v| event("s", v)).collect();
    let p = event("parked", 1);
    let done = event("done", 1);
    store.append_many(&ctx.pool, &evs).await.unwrap();
    store
        .append_many(&ctx.pool, &[p.clone(), done.clone()])
        .await
        .unwrap();
    let b = claim(&store, "r", 10).await;
    store
        .complete(&b.handle, &[park(&p), published(&done, 1)])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _in_flight = claim(&store, "r", 10).await;
    let s = store.stats().await.unwrap();
    assert_eq!(s.unpublished, 3);
    assert_eq!(s.in_flight, 1);
    assert_eq!(s.parked, 1);
    assert_eq!(s.published_retained, 1);
    assert!(s.oldest_claimable_age.unwrap() >= Duration::from_millis(200));
    assert!(s.oldest_parked_age.unwrap() >= Duration::from_millis(200));
    let keys: Vec<&str> = s.extra.iter().map(|(k, _)| k.as_str()).collect();
    for k in [
        "total_bytes",
        "table_bytes",
        "index_bytes",
        "dead_tuples",
        "live_tuples",
        "queued_rows",
        "conditional_update_conflicts",
    ] {
        assert!(keys.contains(&k), "missing {k} in {keys:?}");
    }
    let total = s.extra.iter().find(|(k, _)| k == "total_bytes").unwrap().1;
    assert!(total > 0.0);
    ctx.drop().await;
}

/// An event behind its aggregate's parked head is unpublished and blocked: it counts for the
/// blocked figures, not for the oldest claimable age (issue 20, item 4; this test asserted the
/// opposite before), in both modes.
#[tokio::test]
async fn an_event_behind_a_parked_head_is_blocked_not_claimable() {
    let ctx = ctx!(4);
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let store = ctx.store(mode).await;
        let agg = format!("pk-{mode:?}").replace(' ', "");
        let (v1, v2) = (event(&agg, 1), event(&agg, 2));
        store
            .append_many(&ctx.pool, &[v1.clone(), v2.clone()])
            .await
            .unwrap();
        let b = claim(&store, "r", 10).await;
        assert_eq!(versions(&b), vec![(agg.clone(), 1)]);
        let rep = store.complete(&b.handle, &[park(&v1)]).await.unwrap();
        assert_eq!(rep.applied, 1);
        assert!(
            claim(&store, "r", 10).await.is_empty(),
            "{mode:?}: v2 waits"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
        let s = store.stats().await.unwrap();
        assert_eq!(
            (s.unpublished, s.parked, s.in_flight),
            (1, 1, 0),
            "{mode:?}"
        );
        assert_eq!(s.blocked, 1, "{mode:?}");
        let age = s
            .oldest_blocked_age
            .unwrap_or_else(|| panic!("{mode:?}: v2 is blocked, its age must be reported"));
        assert!(age >= Duration::from_millis(150), "{mode:?}: {age:?}");
        assert_eq!(
            s.oldest_claimable_age, None,
            "{mode:?}: nothing is claimable"
        );
        assert!(s.oldest_parked_age.unwrap() >= Duration::from_millis(150));
        // Discarding the parked head leaves v2 claimable, with its age since insertion; once
        // published, no age is left.
        store
            .discard_parked(v1.event_id, "ops", "test")
            .await
            .unwrap();
        let s = store.stats().await.unwrap();
        assert_eq!((s.blocked, s.oldest_blocked_age), (0, None), "{mode:?}");
        assert!(
            s.oldest_claimable_age
                .is_some_and(|a| a >= Duration::from_millis(150)),
            "{mode:?}: {s:?}"
        );
        let b = claim(&store, "r", 10).await;
        assert_eq!(versions(&b), vec![(agg.clone(), 2)]);
        publish_all(&store, &b).await;
        let s = store.stats().await.unwrap();
        assert_eq!(
            (s.unpublished, s.oldest_claimable_age),
            (0, None),
            "{mode:?}"
        );
    }
    ctx.drop().await;
}

/// Completions commit asynchronously by default; `synchronous_completion(true)` makes them
/// wait for the WAL flush. Both paths record the same outcome, in both claim modes.
#[tokio::test]
async fn completion_commits_with_and_without_waiting_for_the_flush() {
    let ctx = ctx!(4);
    for sync in [false, true] {
        for mode in [lease(30.0), ClaimMode::LockedTransaction] {
            let store = PostgresOutboxStore::builder(ctx.pool.clone())
                .schema(&ctx.schema)
                .claim_mode(mode)
                .synchronous_completion(sync)
                .build()
                .unwrap();
            assert_eq!(store.settings().synchronous_completion, sync);
            store.migrate().await.unwrap();
            let agg = format!("sc-{sync}-{mode:?}").replace(' ', "");
            let (v1, v2) = (event(&agg, 1), event(&agg, 2));
            store
                .append_many(&ctx.pool, &[v1.clone(), v2.clone()])
                .await
                .unwrap();
            let b = claim(&store, "r", 10).await;
            assert_eq!(versions(&b), vec![(agg.clone(), 1)]);
            publish_all(&store, &b).await;
            let b = claim(&store, "r", 10).await;
            assert_eq!(versions(&b), vec![(agg.clone(), 2)], "{sync} {mode:?}");
            publish_all(&store, &b).await;
        }
    }
    assert_eq!(count(&ctx, "status = 'published'").await, 8);
    assert_eq!(leases(&ctx).await, 0);
    ctx.drop().await;
}

#[tokio::test]
async fn inbox_registers_once_per_consumer_and_cleans_up() {
    let ctx = ctx!(4);
    let inbox = ctx.inbox().await;
    let id = EventId::now_v7();
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register_one(&mut tx, "billing", id).await.unwrap(),
        Registration::Fresh
    );
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap(); // the effect, same tx
    inbox.commit(tx).await.unwrap();
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register_one(&mut tx, "billing", id).await.unwrap(),
        Registration::Duplicate
    );
    assert_eq!(
        inbox.register_one(&mut tx, "shipping", id).await.unwrap(),
        Registration::Fresh
    );
    inbox.rollback(tx).await.unwrap();
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register_one(&mut tx, "shipping", id).await.unwrap(),
        Registration::Fresh,
        "rolled back registration is fresh again"
    );
    inbox.commit(tx).await.unwrap();
    assert_eq!(
        inbox
            .cleanup("billing", Duration::from_secs(3600), 10)
            .await
            .unwrap(),
        0
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    // One bounded batch per call, of the cleaning consumer's registrations only.
    assert_eq!(
        inbox
            .cleanup("billing", Duration::from_millis(100), 1)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        inbox
            .cleanup("billing", Duration::from_millis(100), 10)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        inbox
            .cleanup("shipping", Duration::from_millis(100), 10)
            .await
            .unwrap(),
        1
    );
    assert!(inbox
        .cleanup("", Duration::ZERO, 10)
        .await
        .is_err_and(|e| e.kind == StoreErrorKind::Validation));
    assert!(inbox
        .cleanup("billing", Duration::ZERO, 0)
        .await
        .is_err_and(|e| e.kind == StoreErrorKind::Configuration));
    ctx.drop().await;
}

/// Two consumers share one inbox table with different dedup windows: each one's cleanup
/// removes only its own registrations, so the consumer with the longer window still sees a
/// redelivered event as a duplicate (before cleanup took a consumer, the short window removed
/// every consumer's registrations and the redelivery was applied twice).
#[tokio::test]
async fn inbox_cleanup_of_one_consumer_keeps_another_consumers_registrations() {
    let ctx = ctx!(4);
    let inbox = ctx.inbox().await;
    let ids: Vec<EventId> = (0..5).map(|_| EventId::now_v7()).collect();
    let mut tx = inbox.begin().await.unwrap();
    inbox.register(&mut tx, "fast", &ids).await.unwrap();
    inbox.register(&mut tx, "slow", &ids).await.unwrap();
    inbox.commit(tx).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // "fast" keeps 100 ms, "slow" keeps an hour.
    assert_eq!(
        inbox
            .cleanup_candidates("fast", Duration::from_millis(100))
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        inbox
            .cleanup_candidates("slow", Duration::from_secs(3600))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        inbox
            .cleanup_batches("fast", Duration::from_millis(100), 2, 10)
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        inbox
            .cleanup_batches("slow", Duration::from_secs(3600), 2, 10)
            .await
            .unwrap(),
        0
    );
    let left: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT consumer, count(*) FROM \"{}\".processed_events GROUP BY consumer",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(left, vec![("slow".to_owned(), 5)]);
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register(&mut tx, "slow", &ids).await.unwrap(),
        vec![Registration::Duplicate; 5],
        "a redelivery inside the slow consumer's window is still a duplicate"
    );
    assert_eq!(
        inbox.register(&mut tx, "fast", &ids).await.unwrap(),
        vec![Registration::Fresh; 5],
        "the fast consumer's window has passed"
    );
    inbox.rollback(tx).await.unwrap();
    ctx.drop().await;
}

#[tokio::test]
async fn listener_wakes_on_commit() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let notify = Arc::new(tokio::sync::Notify::new());
    let handle = store.spawn_listener(notify.clone()).unwrap();
    // The listener wakes once after connecting; consume that.
    tokio::time::timeout(Duration::from_secs(5), notify.notified())
        .await
        .expect("initial wake-up after connect");
    // It may also leave a permit for a driver between cycles; take it.
    let _ = tokio::time::timeout(Duration::from_millis(100), notify.notified()).await;
    // The relay is idle: its empty claim arms the wake-up gate, so appends notify.
    assert!(claim(&store, "idle", 10).await.is_empty());
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append(&mut *tx, &event("n", 1)).await.unwrap();
    // Not before commit.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), notify.notified())
            .await
            .is_err(),
        "no wake-up before commit"
    );
    tx.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(2), notify.notified())
        .await
        .expect("wake-up after commit");
    handle.abort();
    // A store without a channel cannot listen.
    let quiet = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .notify_channel(None)
        .build()
        .unwrap();
    assert_eq!(
        quiet.spawn_listener(notify).unwrap_err().kind,
        StoreErrorKind::Configuration
    );
    ctx.drop().await;
}

#[tokio::test]
async fn claim_plan_uses_the_partial_indexes() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    // 2,000 aggregates with 10 versions each; every aggregate gets a state row (a large state
    // table must be probed, never scanned).
    let evs: Vec<_> = (0..20_000)
        .map(|i| event(&format!("x{}", i % 2000), i / 2000 + 1))
        .collect();
    for chunk in evs.chunks(5000) {
        store.append_many(&ctx.pool, chunk).await.unwrap();
    }
    for _ in 0..2 {
        let b = claim(&store, "warm", 1000).await;
        publish_all(&store, &b).await;
    }
    for table in ["outbox_events", "outbox_events_aggregate"] {
        sqlx::query(&format!("ANALYZE \"{}\".{table}", ctx.schema))
            .execute(&ctx.pool)
            .await
            .unwrap();
    }
    let blocked_before = count(&ctx, "blocked").await;
    let plans = store.explain_claim(100).await.unwrap();
    assert!(plans[0].contains("outbox_events_claim_idx"), "{}", plans[0]);
    assert!(!plans[0].contains("Seq Scan"), "{}", plans[0]);
    assert!(
        plans[1].contains("outbox_events_unfinished_idx"),
        "{}",
        plans[1]
    );
    assert!(!plans[1].contains("Seq Scan"), "{}", plans[1]);
    // Nothing was claimed by EXPLAIN (rolled back).
    assert_eq!(count(&ctx, "blocked").await, blocked_before);
    assert_eq!(leases(&ctx).await, 0);
    ctx.drop().await;
}

/// The listener survives the loss of its connection: it wakes once on reconnect (notifications
/// may have been lost) and then keeps delivering.
#[tokio::test]
async fn listener_reconnects_after_its_connection_is_killed() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let channel = store.settings().notify_channel.clone().unwrap();
    let notify = Arc::new(tokio::sync::Notify::new());
    let handle = store.spawn_listener(notify.clone()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), notify.notified())
        .await
        .expect("initial wake-up");
    let _ = tokio::time::timeout(Duration::from_millis(100), notify.notified()).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE query ILIKE '%LISTEN%' AND query LIKE '%' || $1 || '%'",
    )
    .bind(&channel)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "the listener's backend was found and terminated");
    // The catch-up wake-up after the reconnect.
    tokio::time::timeout(Duration::from_secs(10), notify.notified())
        .await
        .expect("wake-up after reconnect");
    // Give the new LISTEN a moment, then a commit wakes it again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = tokio::time::timeout(Duration::from_millis(100), notify.notified()).await;
    assert!(claim(&store, "idle", 10).await.is_empty());
    store.append(&ctx.pool, &event("n", 1)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), notify.notified())
        .await
        .expect("wake-up from a commit after the reconnect");
    let listening: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE query ILIKE '%LISTEN%' AND query LIKE '%' || $1 || '%'",
    )
    .bind(&channel)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(listening, 1, "a new connection listens again");
    handle.abort();
    ctx.drop().await;
}

/// A table made by migration 1 (with its index of unblocked rows only) and holding a backlog
/// with blocked rows is upgraded by migration 2 in place, and the relay goes on in order.
/// Migration 3 upgrades a version-2 table in use: the per-aggregate state is derived from the
/// retained rows (or, where cleanup removed them, from the lowest unfinished version), a live
/// lease moves over and still fences, and the backlog drains in order.
#[tokio::test]
async fn migration_3_upgrades_a_version_2_table_in_use() {
    let ctx = ctx!(4);
    common::version_2_schema(&ctx).await;
    // "up": v1, v2 published, v3 in flight under a live lease, v4 queued. "gone": its
    // published rows were cleaned up; v7 waits.
    let store = ctx.store_unmigrated(lease(30.0));
    let up: Vec<_> = (1..=4).map(|v| event("up", v)).collect();
    let gone = event("gone", 7);
    store.append_many(&ctx.pool, &up).await.unwrap();
    store.append(&ctx.pool, &gone).await.unwrap();
    let token = uuid::Uuid::now_v7();
    sqlx::raw_sql(&format!(
        "UPDATE \"{0}\".outbox_events SET status = 'published', published_at = now(), \
            finished_at = now(), ack_topic = 't', ack_partition = 0, ack_offset = 0 \
         WHERE aggregate_id = 'up' AND aggregate_version <= 2; \
         UPDATE \"{0}\".outbox_events SET blocked = true \
         WHERE aggregate_id = 'up' AND aggregate_version = 4; \
         INSERT INTO \"{0}\".outbox_events_lease \
           (aggregate_key, event_row, lease_owner, lease_token, lease_until) \
         SELECT 1, id, 'old-relay', '{token}', now() + interval '1 hour' \
           FROM \"{0}\".outbox_events WHERE aggregate_id = 'up' AND aggregate_version = 3;",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        store.migrate().await.unwrap(),
        9,
        "only migrations 3 to 11 run"
    );
    let state: Vec<(String, i64, Option<String>)> = sqlx::query_as(&format!(
        "SELECT aggregate_id, last_version, lease_owner FROM \"{}\".outbox_events_aggregate \
         ORDER BY aggregate_id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        state,
        vec![
            ("gone".to_owned(), 6, None),
            ("up".to_owned(), 2, Some("old-relay".to_owned())),
        ]
    );
    // The old relay still holds v3 (its lease moved over) and completes it.
    let b = claim(&store, "new", 10).await;
    assert_eq!(versions(&b), vec![("gone".into(), 7)]);
    publish_all(&store, &b).await;
    let old = outbox_core::ClaimHandle {
        token,
        owner: "old-relay".into(),
    };
    let rep = store.complete(&old, &[published(&up[2], 9)]).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (1, 0));
    let b = claim(&store, "new", 10).await;
    assert_eq!(versions(&b), vec![("up".into(), 4)]);
    publish_all(&store, &b).await;
    assert_eq!(count(&ctx, "status = 'published'").await, 5);
    ctx.drop().await;
}

/// A lease that another transaction takes after the claim's snapshot (so the claim's lease
/// probe saw the old, expired lease) wins: the claim's insert waits for it, sees it live and
/// claims nothing.
#[tokio::test]
async fn a_lease_committed_during_the_claim_wins() {
    let ctx = ctx!(6);
    let store = ctx.store(lease(0.05)).await;
    let e = event("raced", 1);
    store.append(&ctx.pool, &e).await.unwrap();
    let first = claim(&store, "r1", 10).await;
    assert_eq!(first.records.len(), 1);
    tokio::time::sleep(Duration::from_millis(120)).await; // the lease has expired
                                                          // Another holder renews the lease (not committed yet).
    let mut other = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events_aggregate SET lease_token = gen_random_uuid(), \
         lease_owner = 'other', lease_until = clock_timestamp() + interval '1 hour'",
        ctx.schema
    ))
    .execute(&mut *other)
    .await
    .unwrap();
    let other_xid = common::xact_id(&mut other).await;
    let racer = {
        let store = store.clone();
        tokio::spawn(async move { claim(&store, "r2", 10).await })
    };
    // Wait until the claim waits for the lease row's lock.
    common::wait_for_waiter_on(&ctx, &other_xid).await;
    other.commit().await.unwrap();
    let second = racer.await.unwrap();
    assert!(
        second.is_empty(),
        "the live lease committed during the claim must win"
    );
    let owner: String = sqlx::query_scalar(&format!(
        "SELECT lease_owner FROM \"{}\".outbox_events_aggregate",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(owner, "other");
    ctx.drop().await;
}

/// The indexes a completed row is written into are exactly these (migration 5 dropped
/// `published_at_idx`): a published row's `published_at` and `finished_at` are one time, and
/// `publish_latency` finds the window's rows through `finished_idx`, old ones left out.
#[tokio::test]
async fn published_rows_have_one_time_index_and_the_latency_window_uses_it() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let evs: Vec<_> = (0..40).map(|i| event(&format!("w{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let batch = claim(&store, "relay-1", 100).await;
    assert_eq!(batch.records.len(), 40);
    publish_all(&store, &batch).await;

    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes \
         WHERE schemaname = $1 AND tablename = 'outbox_events' ORDER BY 1",
    )
    .bind(&ctx.schema)
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [
            "outbox_events_blocked_idx",
            "outbox_events_claim_idx",
            "outbox_events_created_at_idx",
            "outbox_events_event_id_key",
            "outbox_events_finished_idx",
            "outbox_events_held_idx",
            "outbox_events_parked_idx",
            "outbox_events_pkey",
            "outbox_events_unfinished_idx",
        ]
    );
    let unequal: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events \
         WHERE status = 'published' AND published_at IS DISTINCT FROM finished_at",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(unequal, 0, "a published row has one publication time");

    // Ten rows published two hours ago fall out of a one-hour window.
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events SET published_at = published_at - interval '2 hours', \
                finished_at = finished_at - interval '2 hours' \
         WHERE id IN (SELECT id FROM \"{0}\".outbox_events ORDER BY id LIMIT 10)",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let s = store
        .publish_latency(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!((s.count, s.created), (30, 40));
    assert!(s.p50.is_some_and(|p| p >= 0.0));
    // The partial index's predicate is implied by `status = 'published'`; the planner may
    // prefer a scan of this tiny table, so the index's eligibility is what is asserted: with
    // sequential scans off it must be picked.
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL enable_seqscan = off")
        .execute(&mut *tx)
        .await
        .unwrap();
    let forced: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN SELECT count(*) FROM \"{}\".outbox_events \
         WHERE status = 'published' AND finished_at >= now() - interval '1 hour'",
        ctx.schema
    ))
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let forced = forced.join("\n");
    assert!(forced.contains("outbox_events_finished_idx"), "{forced}");
    ctx.drop().await;
}

/// Publishes 30 events of one store and sets their times: event `n` (1..=30, in append
/// order) was published `31 - n` seconds ago, `n` seconds after its creation (latency `n` s).
async fn thirty_published_with_latency_n(ctx: &common::Ctx, store: &PostgresOutboxStore) {
    let evs: Vec<_> = (1..=30).map(|i| event(&format!("l{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let batch = claim(store, "relay-1", 100).await;
    assert_eq!(batch.records.len(), 30);
    publish_all(store, &batch).await;
    sqlx::query(&format!(
        "WITH r AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM \"{s}\".outbox_events), \
              t AS (SELECT id, n, now() - (31 - n) * interval '1 second' AS at FROM r) \
         UPDATE \"{s}\".outbox_events e SET published_at = t.at, finished_at = t.at, \
                created_at = t.at - t.n * interval '1 second' \
         FROM t WHERE e.id = t.id",
        s = ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

fn close(got: Option<f64>, want: f64) -> bool {
    got.is_some_and(|g| (g - want).abs() < 1e-6)
}

/// `publish_latency` reads at most `latency_sample` finished events: up to that many in the
/// window it is exact (`sample` None); above, the percentiles and the largest are those of
/// the window's latest publications and say so (`sample` Some(n)), the count is the window's
/// finished events scaled by the sample's share of published ones.
#[tokio::test]
async fn publish_latency_is_exact_up_to_its_sample_then_a_labelled_estimate() {
    let ctx = ctx!(4);
    let sampled = |n: usize| {
        PostgresOutboxStore::builder(ctx.pool.clone())
            .schema(&ctx.schema)
            .latency_sample(n)
            .build()
            .unwrap()
    };
    let store = sampled(20);
    store.migrate().await.unwrap();
    thirty_published_with_latency_n(&ctx, &store).await;
    let hour = Duration::from_secs(3600);

    // 30 in the window, 20 read: the latest 20 (latencies 11..=30).
    let s = store.publish_latency(hour).await.unwrap();
    assert_eq!((s.count, s.created, s.sample), (30, 30, Some(20)), "{s:?}");
    assert!(close(s.p50, 20.5), "median of 11..=30: {s:?}");
    assert!(close(s.p90, 28.1), "{s:?}");
    assert!(close(s.p99, 29.81), "{s:?}");
    assert!(close(s.max, 30.0), "{s:?}");

    // Up to the sample size, exact over all 30 (1..=30).
    for n in [30, 31] {
        let s = sampled(n).publish_latency(hour).await.unwrap();
        assert_eq!((s.count, s.created, s.sample), (30, 30, None), "{n}: {s:?}");
        assert!(close(s.p50, 15.5), "median of 1..=30: {s:?}");
        assert!(close(s.p90, 27.1), "{s:?}");
        assert!(close(s.p99, 29.71), "{s:?}");
        assert!(close(s.max, 30.0), "{s:?}");
    }
    // A narrower window with fewer finished events than the sample is exact again: the
    // latest 10 (latencies 21..=30, published within the last 10.5 s).
    let s = store
        .publish_latency(Duration::from_millis(10_500))
        .await
        .unwrap();
    assert_eq!((s.count, s.sample), (10, None), "{s:?}");
    assert!(close(s.p50, 25.5), "{s:?}");

    // The latest finished event discarded: the sample holds 19 published events of 20, the
    // count is 30 x 19 / 20 = 28.5, rounded to 29 (the true count); the discarded event's
    // time is not a latency.
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events SET status = 'discarded' \
         WHERE id = (SELECT max(id) FROM \"{0}\".outbox_events)",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let s = store.publish_latency(hour).await.unwrap();
    assert_eq!((s.count, s.sample), (29, Some(19)), "{s:?}");
    assert!(close(s.max, 29.0), "{s:?}");
    assert!(close(s.p50, 20.0), "median of 11..=29: {s:?}");
    let exact = sampled(1000).publish_latency(hour).await.unwrap();
    assert_eq!((exact.count, exact.sample), (29, None), "{exact:?}");
    let zero = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .latency_sample(0)
        .build();
    assert!(zero.is_err(), "a sample of 0 is refused");
    ctx.drop().await;
}

/// Cleanup's retention bound is a scalar subquery (evaluated once), so `finished_idx` is read
/// from its start up to the bound only (an index condition), not to its end with a filter
/// that a bare `clock_timestamp()` would leave (a volatile expression is no index bound): the
/// last, partial batch read every retained row. The statement is the store's own (the
/// canonical text of `sql_mutation`, names replaced). And it removes what it removed before:
/// exactly the rows finished before the retention, oldest first, in batches. (Needs the
/// `sql-mutation` feature for the statement's text; CI builds with `--all-features`.)
#[cfg(feature = "sql-mutation")]
#[tokio::test]
async fn cleanup_bounds_its_index_range_by_the_retention_and_removes_the_same_rows() {
    use outbox_postgres::sql_mutation::{statements, Variant, SCHEMA};
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let evs: Vec<_> = (0..40).map(|i| event(&format!("c{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let batch = claim(&store, "relay-1", 100).await;
    publish_all(&store, &batch).await;
    // The first 10 (by id) finished two hours ago, the others within the last minutes.
    sqlx::query(&format!(
        "UPDATE \"{s}\".outbox_events SET published_at = now() - interval '2 hours' + id * interval '1 ms', \
                finished_at = now() - interval '2 hours' + id * interval '1 ms' \
         WHERE id IN (SELECT id FROM \"{s}\".outbox_events ORDER BY id LIMIT 10)",
        s = ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    sqlx::query(&format!("ANALYZE \"{}\".outbox_events", ctx.schema))
        .execute(&ctx.pool)
        .await
        .unwrap();

    let cleanup = statements(Variant::Plain)
        .into_iter()
        .find(|(name, _)| *name == "cleanup")
        .expect("the cleanup statement")
        .1
        .replace(&format!("\"{SCHEMA}\"."), &format!("\"{}\".", ctx.schema));
    // The planner may prefer a scan of this tiny table: with sequential scans off, the index
    // must be used, and bounded.
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL enable_seqscan = off")
        .execute(&mut *tx)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN (COSTS OFF) {cleanup}"))
        .bind(3_600_000_000i64)
        .bind(4i64)
        .bind(false)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("outbox_events_finished_idx"), "{plan}");
    assert!(
        plan.contains("Index Cond: (finished_at <"),
        "the retention bounds the index range: {plan}"
    );
    assert!(!plan.contains("Filter: (finished_at <"), "{plan}");

    let old: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT id FROM \"{}\".outbox_events ORDER BY id LIMIT 10",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    let rep = store.cleanup(Duration::from_secs(3600), 4).await.unwrap();
    assert_eq!((rep.removed, rep.batches), (10, 3), "4 + 4 + 2");
    let left: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT id FROM \"{}\".outbox_events ORDER BY id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(left.len(), 30);
    assert!(left.iter().all(|id| !old.contains(id)), "{left:?} {old:?}");
    let again = store.cleanup(Duration::from_secs(3600), 4).await.unwrap();
    assert_eq!(again.removed, 0);
    ctx.drop().await;
}
