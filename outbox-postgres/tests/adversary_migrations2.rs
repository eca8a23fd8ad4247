//! Adversary pass on issue 20, item 7: migrations lock the tables they rewrite and run again
//! after a deadlock, to be safe beside relays of the previous version. Attacked here: a locked
//! claim of a version 5 relay that completes while migration 6 waits for it (and a claim that
//! starts meanwhile), a version 5 relay's claim statement prepared before the migration and
//! run again after it on the same connection, and a migration whose server session is
//! terminated while it waits, then run again.
//!
//! The relays of the previous version are played by their statements, as in
//! `adversary_migrations.rs`.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::ClaimMode;
use sqlx::{Connection, Row};

use common::{claim, event, lease, publish_all, versions};

/// `last_version` of `agg`'s state row (`None`: no row).
async fn last(ctx: &common::Ctx, agg: &str) -> Option<Option<i64>> {
    sqlx::query_scalar(&format!(
        "SELECT last_version FROM \"{}\".outbox_events_aggregate WHERE aggregate_id = $1",
        ctx.schema
    ))
    .bind(agg)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
}

async fn applied(ctx: &common::Ctx) -> Vec<i32> {
    sqlx::query_scalar(&format!(
        "SELECT version FROM \"{}\".outbox_schema_migrations \
          WHERE object = 'outbox:outbox_events' ORDER BY version",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Whether backend `pid` holds the migration runner's advisory lock (`schema::migrate`).
async fn holds_migrate_lock(ctx: &common::Ctx, pid: i32) -> bool {
    sqlx::query_scalar(
        "SELECT count(*) > 0 FROM pg_locks l, \
                (SELECT hashtextextended('outbox-postgres:migrate', 0) AS k) m \
          WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
            AND l.classid::int8 = (m.k >> 32) & 4294967295 AND l.objid::int8 = m.k & 4294967295 \
            AND l.pid = $1",
    )
    .bind(pid)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// Backends of this database waiting for a lock on a table of the test's schema.
async fn lock_waiters(ctx: &common::Ctx) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT DISTINCT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE NOT l.granted AND n.nspname = $1",
    )
    .bind(&ctx.schema)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Whether a claim's transaction (its `BEGIN` takes the migration key shared) waits for
/// backend `migration`.
async fn claim_waits_for(ctx: &common::Ctx, migration: i32) -> bool {
    sqlx::query_scalar(
        "SELECT count(*) > 0 FROM pg_stat_activity \
          WHERE $1 = ANY(pg_blocking_pids(pid)) AND wait_event_type = 'Lock' \
            AND query LIKE '%pg_advisory_xact_lock_shared%'",
    )
    .bind(migration)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A locked claim of a version 5 relay reads the state table (its decision) and holds it
/// until its completion commits; migration 6 waits for it. The completion then writes the
/// state table (a stronger lock than it held) without deadlocking with the waiting migration
/// (the server grants it ahead of the migration, whose request conflicts with what the relay
/// already holds), and the migration keeps the version it wrote. The migration waits for the
/// state table alone (it holds no other table meanwhile, so the completion's write of the event
/// table does not wait). A claim that starts while the migration waits queues behind the
/// migration (the stall lasts as long as the old relay's transaction) and then runs on the new
/// schema.
#[tokio::test]
async fn migration_6_beside_a_locked_claim_of_version_5_that_completes() {
    let ctx = ctx!(8);
    common::schema_at_version(&ctx, 5).await;
    let store = ctx.store_unmigrated(ClaimMode::LockedTransaction);
    store
        .append_many(&ctx.pool, &[event("locked", 1), event("locked", 2)])
        .await
        .unwrap();
    store.append(&ctx.pool, &event("other", 1)).await.unwrap();
    let s = &ctx.schema;
    // The old relay's locked claim: its decision reads the state table.
    let mut old = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT count(*) FROM \"{s}\".outbox_events_aggregate a \
          WHERE a.aggregate_id = 'locked'"
    ))
    .execute(&mut *old)
    .await
    .unwrap();
    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    common::wait_for_lock_wait(&ctx).await;
    let waiters = lock_waiters(&ctx).await;
    assert_eq!(waiters.len(), 1, "only the migration waits: {waiters:?}");
    let migration = waiters[0];
    // A new relay's claim starts now: it waits for the migration (on the migration key, before
    // it reads a table).
    let new_claim = {
        let store = store.clone();
        tokio::spawn(async move { claim(&store, "new", 10).await })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !claim_waits_for(&ctx, migration).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the claim never queued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The append wrote v2 blocked behind v1 (one batch, docs/design/hot-aggregate.md): only the
    // old relay's completion can release it.
    assert!(
        common::blocked(&ctx, "locked", 2).await,
        "written blocked by the append"
    );
    let promotion =
        common::old_relay_promotion(&ctx, "aggregate_id = 'locked' AND aggregate_version = 1");
    // The old relay's completion: v1 published, its state written and the aggregate's first
    // blocked row promoted as version 5 does.
    let completion = tokio::time::timeout(
        Duration::from_secs(5),
        sqlx::raw_sql(&format!(
            "UPDATE \"{s}\".outbox_events SET status = 'published', published_at = now(), \
                finished_at = now(), ack_topic = 't', ack_partition = 0, ack_offset = 0 \
              WHERE aggregate_id = 'locked' AND aggregate_version = 1; \
             INSERT INTO \"{s}\".outbox_events_aggregate AS a \
               (aggregate_key, aggregate_type, aggregate_id, last_version) \
             SELECT hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), \
                    aggregate_type, aggregate_id, aggregate_version \
               FROM \"{s}\".outbox_events WHERE aggregate_id = 'locked' AND aggregate_version = 1 \
             ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
               SET last_version = GREATEST(a.last_version, EXCLUDED.last_version); {promotion}"
        ))
        .execute(&mut *old),
    )
    .await;
    assert!(
        matches!(completion, Ok(Ok(_))),
        "the old relay's completion must neither wait for the migration nor fail: {completion:?}"
    );
    assert!(
        !migrating.is_finished(),
        "the migration waits for the old relay"
    );
    old.commit().await.unwrap();
    let b = new_claim.await.unwrap();
    // The new claim runs once the migrations' transaction committed (it waited on the
    // migration key); `migrate` itself returns after migration 10's concurrent index build,
    // which waits for that locked claim's transaction: it is awaited after the completion.
    assert_eq!(
        last(&ctx, "locked").await,
        Some(Some(1)),
        "kept, not repaired"
    );
    assert_eq!(
        versions(&b),
        vec![("locked".into(), 2), ("other".into(), 1)],
        "held {}, parked {:?}",
        b.gaps_held,
        b.parked
    );
    publish_all(&store, &b).await;
    assert_eq!(migrating.await.unwrap().unwrap(), 6, "migrations 6 to 11");
    ctx.drop().await;
}

/// A version 5 relay prepared its lease claim statement (it names no `last_version`, so the
/// column default filled it: 0) before migration 6, and runs it again on the same connection
/// after: the server plans it again against the new definition, and the state row gets an
/// unknown last version, not 0.
#[tokio::test]
async fn a_statement_of_version_5_prepared_before_migration_6_writes_no_zero_after_it() {
    let ctx = ctx!(6);
    common::schema_at_version(&ctx, 5).await;
    let store = ctx.store_unmigrated(lease(30.0));
    for agg in ["before", "after"] {
        store.append(&ctx.pool, &event(agg, 3)).await.unwrap();
    }
    let v5_claim = format!(
        "INSERT INTO \"{0}\".outbox_events_aggregate AS a (aggregate_key, aggregate_type, \
           aggregate_id, lease_owner, lease_token, lease_until, lease_row) \
         SELECT hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), \
                aggregate_type, aggregate_id, 'relay-v5', gen_random_uuid(), \
                clock_timestamp() + interval '1 hour', id \
           FROM \"{0}\".outbox_events WHERE aggregate_id = $1",
        ctx.schema
    );
    let mut conn = ctx.pool.acquire().await.unwrap().detach();
    sqlx::query(&v5_claim)
        .bind("before")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(last(&ctx, "before").await, Some(Some(0)));
    assert_eq!(store.migrate().await.unwrap(), 6, "migrations 6 to 11");
    assert_eq!(last(&ctx, "before").await, Some(None), "repaired");
    // The same prepared statement (sqlx's statement cache on this connection).
    sqlx::query(&v5_claim)
        .bind("after")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        last(&ctx, "after").await,
        Some(None),
        "no default of 0 any more"
    );
    conn.close().await.unwrap();
    ctx.drop().await;
}

/// Migrations 3 to 6 from version 2, the session running them terminated by an operator
/// (`pg_terminate_backend`) while it waits for a relay of version 2: the migration fails,
/// nothing of it remains (the schema is still at version 2, no state table), the migration
/// lock is gone with the session, and running it again applies everything on the data the
/// old relay left.
#[tokio::test]
async fn a_migration_terminated_while_it_waits_runs_again() {
    let ctx = ctx!(8);
    common::version_2_schema(&ctx).await;
    let store = ctx.store_unmigrated(lease(30.0));
    store
        .append_many(&ctx.pool, &[event("killed", 1), event("killed", 2)])
        .await
        .unwrap();
    // The old relay publishes v1 in a transaction that is open while the migration starts.
    let mut old = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events SET status = 'published', published_at = now(), \
            finished_at = now(), ack_topic = 't', ack_partition = 0, ack_offset = 0 \
          WHERE aggregate_id = 'killed' AND aggregate_version = 1",
        ctx.schema
    ))
    .execute(&mut *old)
    .await
    .unwrap();
    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    common::wait_for_lock_wait(&ctx).await;
    let waiters = lock_waiters(&ctx).await;
    assert_eq!(waiters.len(), 1, "{waiters:?}");
    assert!(
        holds_migrate_lock(&ctx, waiters[0]).await,
        "the waiting migration holds the runner's lock"
    );
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(waiters[0])
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    assert!(killed);
    let err = migrating
        .await
        .unwrap()
        .expect_err("the migration's session was terminated");
    eprintln!("terminated migration: {err}");
    assert_eq!(applied(&ctx).await, [1, 2], "nothing of it was recorded");
    let state_table: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("\"{}\".outbox_events_aggregate", ctx.schema))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    assert_eq!(state_table, None, "nothing of it was created");
    old.commit().await.unwrap();
    // The runner's lock went with the session: running it again does not wait for ever.
    let again = tokio::time::timeout(Duration::from_secs(30), store.migrate())
        .await
        .expect("the migration lock was left behind");
    assert_eq!(again.unwrap(), 9, "migrations 3 to 11 run again");
    assert_eq!(applied(&ctx).await, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(last(&ctx, "killed").await, Some(Some(1)));
    let b = claim(&store, "new", 10).await;
    assert_eq!(versions(&b), vec![("killed".into(), 2)]);
    publish_all(&store, &b).await;
    let row = sqlx::query(&format!(
        "SELECT count(*) AS n FROM \"{}\".outbox_events WHERE status = 'published'",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<i64, _>("n"), 2);
    ctx.drop().await;
}
