//! Per-aggregate order and serialization against a real PostgreSQL, with the interleavings
//! forced deterministically: a transaction is held open and the test waits (through
//! `pg_locks`) until the other side is blocked behind it.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimRequest, Envelope, ErrorClass, LastError, Outcome, ParkKind, ParkReason,
};
use outbox_postgres::PostgresOutboxStore;
use sqlx::PgPool;

use common::{claim, event, lease, publish_all, published, versions};

async fn status(pool: &PgPool, schema: &str, e: &Envelope) -> String {
    sqlx::query_scalar(&format!(
        "SELECT status FROM \"{schema}\".outbox_events WHERE event_id = $1"
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(pool)
    .await
    .unwrap()
}

// A version that commits after a higher one goes out first: the shared scenario
// `late_lower_version_is_published_first_in_both_modes` in `relays.rs`.

/// A duplicate of a version that became stale while it was blocked behind its in-flight twin
/// is parked as out of order, and the versions after it still flow.
#[tokio::test]
async fn a_blocked_duplicate_version_is_parked_and_the_chain_continues() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let (v1, v2) = (event("dup", 1), event("dup", 2));
    store.append(&ctx.pool, &v1).await.unwrap();
    let b = claim(&store, "r", 100).await;
    assert_eq!(versions(&b), vec![("dup".into(), 1)]);
    // A second version 1 and version 2 arrive while v1 is in flight: both are queued.
    let twin = event("dup", 1);
    store
        .append_many(&ctx.pool, &[twin.clone(), v2.clone()])
        .await
        .unwrap();
    let other = ctx.store(lease(30.0)).await;
    assert!(claim(&other, "o", 100).await.is_empty());
    publish_all(&store, &b).await;
    let b = claim(&store, "r", 100).await;
    assert!(
        b.records
            .iter()
            .all(|r| r.envelope.event_id != twin.event_id),
        "the stale twin went out"
    );
    assert_eq!(status(&ctx.pool, &ctx.schema, &twin).await, "parked");
    let mut got = versions(&b);
    if got.is_empty() {
        got = versions(&claim(&store, "r", 100).await);
    }
    assert_eq!(got, vec![("dup".into(), 2)]);
    ctx.drop().await;
}

/// Issue 9, item 1: a completion with a Park or Retry outcome serializes with claims of the
/// same aggregate. Relay A's lease on X has expired (so another relay may take X over), and A's
/// completion is in progress (held up behind a row lock this test holds). Relay B's claim must
/// not hand X out: before the fix, a Park/Retry completion took no aggregate lock and B took
/// the released lease, publishing a parked or retry-delayed event.
#[tokio::test]
async fn a_park_or_retry_in_progress_is_never_overtaken_by_a_claim() {
    for outcome_kind in ["park", "retry"] {
        let ctx = ctx!(6);
        let a = ctx.store(lease(0.2)).await;
        let b = ctx.store(lease(0.2)).await;
        let (x1, x2) = (event("x", 1), event("x", 2));
        a.append_many(&ctx.pool, &[x1.clone(), x2.clone()])
            .await
            .unwrap();
        let claimed = claim(&a, "relay-a", 100).await;
        assert_eq!(versions(&claimed), vec![("x".into(), 1)]);
        tokio::time::sleep(Duration::from_millis(300)).await; // A's lease has expired
        let outcome = match outcome_kind {
            "park" => Outcome::Park {
                event_id: x1.event_id,
                reason: ParkReason {
                    kind: ParkKind::PermanentError,
                    error: LastError {
                        class: ErrorClass::Permanent,
                        kind: "record_too_large".into(),
                        message: "too big".into(),
                    },
                },
            },
            _ => Outcome::Retry {
                event_id: x1.event_id,
                delay: Duration::from_secs(3),
                error: LastError {
                    class: ErrorClass::Transient,
                    kind: "other".into(),
                    message: "flaky".into(),
                },
            },
        };
        // Hold X's row so that A's completion stops in the middle.
        let mut blocker = ctx.pool.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT 1 FROM \"{}\".outbox_events WHERE event_id = $1 FOR UPDATE",
            ctx.schema
        ))
        .bind(x1.event_id.as_uuid())
        .execute(&mut *blocker)
        .await
        .unwrap();
        let xid = common::xact_id(&mut blocker).await;
        let completing = {
            let (a, handle) = (a.clone(), claimed.handle.clone());
            tokio::spawn(async move { a.complete(&handle, &[outcome]).await })
        };
        common::wait_for_waiter_on(&ctx, &xid).await;
        // B claims while A's completion is in progress. (It may return at once or wait behind
        // A; either way it must not end up with X.)
        let racing = {
            let b = b.clone();
            tokio::spawn(async move { claim(&b, "relay-b", 100).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        blocker.commit().await.unwrap();
        let during = racing.await.unwrap();
        assert!(
            during.is_empty(),
            "{outcome_kind}: relay B was handed {:?} while A's completion was in progress",
            versions(&during)
        );
        let rep = completing.await.unwrap().unwrap();
        assert_eq!((rep.applied, rep.superseded), (1, 0), "{outcome_kind}");
        let after = claim(&b, "relay-b", 100).await;
        assert!(
            after.is_empty(),
            "{outcome_kind}: X was handed out after its {outcome_kind}: {:?}",
            versions(&after)
        );
        if outcome_kind == "park" {
            assert_eq!(status(&ctx.pool, &ctx.schema, &x1).await, "parked");
        } else {
            tokio::time::sleep(Duration::from_millis(3200)).await;
            let later = claim(&b, "relay-b", 100).await;
            assert_eq!(versions(&later), vec![("x".into(), 1)]);
            assert_eq!(later.records[0].attempts, 1);
        }
        ctx.drop().await;
    }
}

/// Issue 9, item 4: lease claims and operator actions commit with `synchronous_commit = on`
/// even when the role's default is `off` (completions are asynchronous by design). A trigger
/// records the setting in effect when each statement writes.
#[tokio::test]
async fn durable_commits_do_not_depend_on_the_role_default() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let role = format!(
        "outbox_sc_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let s = &ctx.schema;
    sqlx::raw_sql(&format!(
        "CREATE ROLE {role} LOGIN SUPERUSER; \
         ALTER ROLE {role} SET synchronous_commit = off; \
         CREATE TABLE \"{s}\".sc_log (tbl text, op text, setting text); \
         CREATE FUNCTION \"{s}\".sc_rec() RETURNS trigger LANGUAGE plpgsql AS $$ \
           BEGIN INSERT INTO \"{s}\".sc_log VALUES (TG_TABLE_NAME, TG_OP, \
             current_setting('synchronous_commit')); RETURN NULL; END $$; \
         CREATE TRIGGER sc AFTER INSERT OR UPDATE ON \"{s}\".outbox_events_aggregate \
           FOR EACH ROW EXECUTE FUNCTION \"{s}\".sc_rec(); \
         CREATE TRIGGER sc AFTER INSERT ON \"{s}\".outbox_events_audit \
           FOR EACH ROW EXECUTE FUNCTION \"{s}\".sc_rec();"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned());
    let opts: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(opts.username(&role))
        .await
        .unwrap();
    let default: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(default, "off", "setup: the role's default must be off");
    let as_role = PostgresOutboxStore::builder(pool.clone())
        .schema(s)
        .claim_mode(lease(30.0))
        .build()
        .unwrap();
    let e = event("durable", 1);
    as_role.append(&pool, &e).await.unwrap();
    let b = claim(&as_role, "r", 100).await;
    let park = Outcome::Park {
        event_id: e.event_id,
        reason: ParkReason {
            kind: ParkKind::PermanentError,
            error: LastError {
                class: ErrorClass::Permanent,
                kind: "invalid_record".into(),
                message: "bad".into(),
            },
        },
    };
    as_role.complete(&b.handle, &[park]).await.unwrap();
    as_role.retry_parked(e.event_id, "ops").await.unwrap();
    let log: Vec<(String, String, String)> =
        sqlx::query_as(&format!("SELECT tbl, op, setting FROM \"{s}\".sc_log"))
            .fetch_all(&ctx.pool)
            .await
            .unwrap();
    // claim (insert of the lease), completion (update, asynchronous by design), operator
    // retry (state update and audit).
    assert_eq!(
        log,
        vec![
            (
                "outbox_events_aggregate".into(),
                "INSERT".into(),
                "on".into()
            ),
            (
                "outbox_events_aggregate".into(),
                "UPDATE".into(),
                "off".into()
            ),
            (
                "outbox_events_aggregate".into(),
                "UPDATE".into(),
                "on".into()
            ),
            ("outbox_events_audit".into(), "INSERT".into(), "on".into()),
        ]
    );
    pool.close().await;
    drop(store);
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    ctx.drop().await;
}

/// Issue 9, item 9: a locked claim that is neither completed nor released (a relay task that
/// died) is dropped by the store once the server has ended its transaction, instead of
/// holding a connection for ever.
#[tokio::test]
async fn abandoned_locked_claims_are_dropped_after_the_hold_limit() {
    let ctx = ctx!(6);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(ClaimMode::LockedTransaction)
        .locked_max_hold(Duration::from_millis(300))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let e = event("leaky", 1);
    store.append(&ctx.pool, &e).await.unwrap();
    let leaked = claim(&store, "r", 100).await;
    assert_eq!(leaked.records.len(), 1);
    assert_eq!(store.open_locked_claims(), 1);
    tokio::time::sleep(Duration::from_millis(600)).await;
    // The server ended the idle transaction; the next claim forgets it and gets the row.
    let again = claim(&store, "r", 100).await;
    assert_eq!(versions(&again), vec![("leaky".into(), 1)]);
    assert_eq!(store.open_locked_claims(), 1, "the leaked claim is gone");
    let rep = store
        .complete(&leaked.handle, &[published(&e, 1)])
        .await
        .unwrap();
    assert_eq!(
        rep.applied, 0,
        "the abandoned claim's completion must be refused"
    );
    publish_all(&store, &again).await;
    ctx.drop().await;
}

/// A claim try-locks the aggregates of the candidates it takes, not the whole backlog: with a
/// stale row estimate after a burst of appends, a plan that filters every pending row before
/// sorting would lock them all and keep other relays from every aggregate until it commits.
#[tokio::test]
async fn a_claim_locks_only_the_candidates_it_takes() {
    let ctx = ctx!(4);
    let store = ctx.store(ClaimMode::LockedTransaction).await;
    // A burst right after creation: the table has no statistics yet.
    let evs: Vec<_> = (0..5000).map(|i| event(&format!("burst-{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = store
        .claim(&ClaimRequest::new("r", 10))
        .await
        .expect("claim");
    assert_eq!(b.records.len(), 10);
    let locks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database() \
           AND a.state = 'idle in transaction' AND l.mode = 'ExclusiveLock' \
           AND strpos(a.query, $1) > 0",
    )
    // Only the sessions whose last statement named this test's schema: other tests (and a
    // mutation run) sharing the database hold advisory locks of their own.
    .bind(&ctx.schema)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert!(
        (10..=20).contains(&locks),
        "a claim of 10 holds {locks} aggregate locks"
    );
    publish_all(&store, &b).await;
    ctx.drop().await;
}
