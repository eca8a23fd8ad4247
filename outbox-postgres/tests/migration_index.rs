//! Index migrations on a table in use (issue 25): migration 10's index of held version gaps is
//! built with `CREATE INDEX CONCURRENTLY` after the migrations' transaction, so appends (the
//! business transactions) go on while it is built; an invalid index left by an interrupted
//! concurrent build is dropped and built again by the next run; a run with nothing to do
//! changes nothing.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_postgres::PostgresOutboxStore;
use sqlx::Connection;

use common::{event, lease, Ctx};

const INDEX: &str = "outbox_events_held_idx";

/// A store over the test's schema whose table is at version 9 and holds `rows` finished
/// events: migrated, then migrations 10 and 11 taken back (the index dropped, their log rows
/// deleted; the column of 11 stays, which its migration adds only if it is missing).
async fn table_at_version_9(ctx: &Ctx, rows: i64) -> PostgresOutboxStore {
    let store = ctx.store(lease(30.0)).await;
    let s = &ctx.schema;
    sqlx::raw_sql(&format!(
        "DROP INDEX \"{s}\".{INDEX}; \
         DELETE FROM \"{s}\".outbox_schema_migrations \
           WHERE object = 'outbox:outbox_events' AND version >= 10; \
         INSERT INTO \"{s}\".outbox_events (event_id, aggregate_type, aggregate_id, \
             aggregate_version, event_type, schema_version, content_type, payload, created_at, \
             status, finished_at, discard_reason) \
           SELECT gen_random_uuid(), 'bulk', i::text, 1, 'bulk.done', 1, \
                  'application/octet-stream', convert_to(repeat('x', 1000), 'UTF8'), now(), \
                  'discarded', now(), 'test' \
           FROM generate_series(1, {rows}) AS i;"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    store
}

/// `(oid, valid)` of the held-gaps index, `None` when there is none.
async fn index(ctx: &Ctx) -> Option<(u32, bool)> {
    let row: Option<(sqlx::postgres::types::Oid, bool)> = sqlx::query_as(
        "SELECT i.indexrelid, i.indisvalid FROM pg_index i \
         WHERE i.indexrelid = to_regclass($1)",
    )
    .bind(format!("\"{}\".{INDEX}", ctx.schema))
    .fetch_optional(&ctx.pool)
    .await
    .unwrap();
    row.map(|(oid, valid)| (oid.0, valid))
}

async fn applied_versions(ctx: &Ctx) -> Vec<i32> {
    sqlx::query_scalar(&format!(
        "SELECT version FROM \"{}\".outbox_schema_migrations \
         WHERE object = 'outbox:outbox_events' ORDER BY version",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Whether an index build on the test's table is under way: it reports progress, or it
/// waits for a lock on a table of the schema (a plain `CREATE INDEX` queued for its `SHARE`
/// lock reports no progress yet).
async fn index_build_under_way(ctx: &Ctx) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_progress_create_index \
                        WHERE relid = to_regclass($1)) \
             OR EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                        JOIN pg_namespace n ON n.oid = c.relnamespace \
                        WHERE NOT l.granted AND n.nspname = $2)",
    )
    .bind(format!("\"{}\".outbox_events", ctx.schema))
    .bind(&ctx.schema)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

async fn wait_for_index_build(ctx: &Ctx) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !index_build_under_way(ctx).await {
        assert!(
            std::time::Instant::now() < deadline,
            "no index build on {}.outbox_events started",
            ctx.schema
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An append with a short `lock_timeout`, in its own transaction.
async fn append_within(ctx: &Ctx, store: &PostgresOutboxStore, agg: &str) -> Result<(), String> {
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '300ms'")
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .append(&mut *tx, &event(agg, 1))
        .await
        .map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())
}

/// While migration 10 builds its index on a table of 20,000 rows, appends go on. A write of
/// the test holds the table when the migration starts, so the build stays under way as long
/// as the test needs (a build waits for the writers it found; then it scans the table): a
/// plain `CREATE INDEX` in the migrations' transaction queues for its `SHARE` lock behind that
/// write, and every append queues behind it (then waits for the whole scan); a concurrent
/// build takes a lock appends do not conflict with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_go_on_while_the_index_is_built() {
    let ctx = ctx!(8);
    let store = table_at_version_9(&ctx, 20_000).await;

    // A business transaction in flight when the migration starts.
    let mut writer = ctx.pool.begin().await.unwrap();
    store
        .append(&mut *writer, &event("in-flight", 1))
        .await
        .unwrap();

    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    wait_for_index_build(&ctx).await;

    // Appends while the build is under way: each within 300 ms of lock waiting.
    for i in 0..3 {
        append_within(&ctx, &store, &format!("during-{i}"))
            .await
            .unwrap_or_else(|e| panic!("append {i} during the index build: {e}"));
    }
    assert!(
        index_build_under_way(&ctx).await && !migrating.is_finished(),
        "the migration ended before the appends: the test proved nothing"
    );

    writer.commit().await.unwrap();
    let applied = tokio::time::timeout(Duration::from_secs(60), migrating)
        .await
        .expect("migration finished")
        .unwrap()
        .expect("migrate");
    assert_eq!(applied, 2, "migrations 10 and 11 applied");
    assert!(matches!(index(&ctx).await, Some((_, true))), "index valid");
    assert_eq!(applied_versions(&ctx).await, (1..=11).collect::<Vec<_>>());
    // Appends after the build, too (the index is maintained, nothing is left locked).
    append_within(&ctx, &store, "after").await.unwrap();
    ctx.drop().await;
}

/// A concurrent build cancelled half way leaves an invalid index under the index's name
/// (`CREATE INDEX CONCURRENTLY IF NOT EXISTS` would then do nothing): the next run drops it
/// and builds it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_index_left_by_an_interrupted_build_is_built_again() {
    let ctx = ctx!(8);
    let store = table_at_version_9(&ctx, 2_000).await;
    // Migration 10 recorded (as a run that stopped before its build does), no index yet.
    assert_eq!(store.migrate().await.unwrap(), 2);
    let s = &ctx.schema;
    sqlx::raw_sql(&format!("DROP INDEX \"{s}\".{INDEX}"))
        .execute(&ctx.pool)
        .await
        .unwrap();

    // An interrupted build: it waits for a transaction that writes the table; cancelled then.
    let mut writer = ctx.pool.begin().await.unwrap();
    store
        .append(&mut *writer, &event("in-flight", 1))
        .await
        .unwrap();
    let mut builder = ctx.pool.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *builder)
        .await
        .unwrap();
    let build = format!(
        "CREATE INDEX CONCURRENTLY {INDEX} ON \"{s}\".outbox_events (id) \
         WHERE status = 'pending' AND held_since IS NOT NULL"
    );
    let cancel = async {
        wait_for_index_build(&ctx).await;
        let cancelled: bool = sqlx::query_scalar("SELECT pg_cancel_backend($1)")
            .bind(pid)
            .fetch_one(&ctx.pool)
            .await
            .unwrap();
        assert!(cancelled);
    };
    let (result, ()) = tokio::join!(sqlx::raw_sql(&build).execute(&mut *builder), cancel);
    assert!(result.is_err(), "the build was cancelled");
    let _ = builder.detach().close().await;
    writer.rollback().await.unwrap();
    let (invalid_oid, valid) = index(&ctx).await.expect("an index is left");
    assert!(!valid, "the interrupted build left an invalid index");

    assert_eq!(store.migrate().await.unwrap(), 0, "no migration to apply");
    let (oid, valid) = index(&ctx).await.expect("index");
    assert!(valid, "the index is valid after the next run");
    assert_ne!(
        oid, invalid_oid,
        "the invalid index was dropped and built again"
    );
    // The planner uses it: the held gaps are read through it.
    let plan: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN SELECT id FROM \"{s}\".outbox_events \
         WHERE status = 'pending' AND held_since IS NOT NULL"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(plan.join("\n").contains(INDEX), "{}", plan.join("\n"));
    ctx.drop().await;
}

/// A run with nothing to do is a no-op: after a concurrent build (an upgraded table) and after
/// a new installation (where the index is built in the migrations' transaction), the next
/// run applies nothing and leaves the index as it is (not built again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_again_changes_nothing() {
    for upgraded in [true, false] {
        let ctx = ctx!(4);
        let store = if upgraded {
            let store = table_at_version_9(&ctx, 1_000).await;
            assert_eq!(store.migrate().await.unwrap(), 2);
            store
        } else {
            ctx.store(lease(30.0)).await
        };
        let (oid, valid) = index(&ctx).await.expect("index");
        assert!(valid, "upgraded={upgraded}");
        let log = applied_versions(&ctx).await;
        assert_eq!(log, (1..=11).collect::<Vec<_>>(), "upgraded={upgraded}");
        for _ in 0..2 {
            assert_eq!(store.migrate().await.unwrap(), 0, "upgraded={upgraded}");
            assert_eq!(index(&ctx).await, Some((oid, true)), "upgraded={upgraded}");
            assert_eq!(applied_versions(&ctx).await, log, "upgraded={upgraded}");
        }
        ctx.drop().await;
    }
}

/// `(valid)` of index `name` in the test's schema, `None` when there is none.
async fn valid(ctx: &Ctx, name: &str) -> Option<bool> {
    sqlx::query_scalar("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)")
        .bind(format!("\"{}\".{name}", ctx.schema))
        .fetch_optional(&ctx.pool)
        .await
        .unwrap()
}

/// The other index steps: migration 4's index of creation times on an event table of version
/// 3, and the inbox's migration 3 index of registrations on an inbox table of version 2, are
/// built (after the transaction) by the upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_build_the_index_steps_of_earlier_migrations() {
    let ctx = ctx!(4);
    common::schema_at_version(&ctx, 3).await;
    assert_eq!(valid(&ctx, "outbox_events_created_at_idx").await, None);
    let store = ctx.store_unmigrated(lease(30.0));
    assert_eq!(store.migrate().await.unwrap(), 8, "migrations 4 to 11");
    assert_eq!(
        valid(&ctx, "outbox_events_created_at_idx").await,
        Some(true)
    );
    assert_eq!(valid(&ctx, INDEX).await, Some(true));

    // The inbox at version 2: migrated, then its migrations from 3 on taken back (they run
    // again as no-ops: `IF NOT EXISTS`) and the index dropped.
    let inbox = ctx.inbox().await;
    let s = &ctx.schema;
    sqlx::raw_sql(&format!(
        "DROP INDEX \"{s}\".processed_events_consumer_at_idx; \
         DELETE FROM \"{s}\".outbox_schema_migrations \
           WHERE object = 'inbox:processed_events' AND version >= 3;"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(inbox.migrate().await.unwrap(), 3, "inbox migrations 3 to 5");
    assert_eq!(
        valid(&ctx, "processed_events_consumer_at_idx").await,
        Some(true)
    );
    ctx.drop().await;
}
