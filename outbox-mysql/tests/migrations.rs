//! Upgrades of a database migrated by an earlier version of this crate, beside processes of
//! that version: inbox migration 2 (registrations keep their aggregate), and the bound on how
//! long a migration's DDL waits for its table (a transaction left open must not stall every
//! consumer behind the migration). Migrations are serialized server-wide by a named lock, so
//! the test that holds a migration back for `MIGRATION_DDL_WAIT_SECS` delays the others' by as
//! much.
//!
//! Each test has its own database on the server at `MYSQL_URL`.

mod common;

use outbox_core::{AggregateKey, AggregateRegistration, EventId, InboxStore};

/// Turns the inbox of `ctx` back into its migration-1 shape (the column of migration 2 gone,
/// the migration log at version 1).
async fn back_to_inbox_v1(ctx: &common::Ctx) {
    sqlx::query(&format!(
        "ALTER TABLE {} DROP COLUMN aggregate",
        ctx.table("processed_events")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    forget_inbox_v2(ctx).await;
}

/// Removes migration 2 from the log (as a run that failed after its DDL committed leaves it).
async fn forget_inbox_v2(ctx: &common::Ctx) {
    sqlx::query(&format!(
        "DELETE FROM {} WHERE object = 'inbox:processed_events' AND version = 2",
        ctx.table("outbox_schema_migrations")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// Inbox migration 2 on a database of migration 1 with registrations of the previous version,
/// while a consumer of that version keeps registering (its INSERT names its columns): the
/// migration applies once; registrations without an aggregate (old ones, and new ones from the
/// old consumer) are duplicates for any aggregate, as before; and a run that failed after its
/// DDL committed (the log not written) applies again without error (MySQL has no
/// `ADD COLUMN IF NOT EXISTS`; the runner takes "duplicate column" as applied).
#[tokio::test]
async fn inbox_migration_2_upgrades_beside_consumers_of_the_previous_version() {
    let ctx = ctx!(4);
    let inbox = ctx.inbox().await;
    back_to_inbox_v1(&ctx).await;
    let old_insert = format!(
        "INSERT INTO {} (consumer, event_id, processed_at) VALUES (?, ?, UTC_TIMESTAMP(6))",
        ctx.table("processed_events")
    );
    let (before, during) = (EventId::now_v7(), EventId::now_v7());
    sqlx::query(&old_insert)
        .bind("c")
        .bind(before.as_uuid())
        .execute(&ctx.pool)
        .await
        .unwrap();
    assert_eq!(inbox.migrate().await.unwrap(), 1, "migration 2 applies");
    // The consumer of the previous version, after the upgrade.
    sqlx::query(&old_insert)
        .bind("c")
        .bind(during.as_uuid())
        .execute(&ctx.pool)
        .await
        .unwrap();
    let a = AggregateKey::new("order", "o-1");
    let fresh = EventId::now_v7();
    let mut tx = inbox.begin().await.unwrap();
    let got = inbox
        .register_for(
            &mut tx,
            "c",
            &[(before, a.clone()), (during, a.clone()), (fresh, a.clone())],
        )
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
    assert_eq!(
        got,
        [
            AggregateRegistration::Duplicate,
            AggregateRegistration::Duplicate,
            AggregateRegistration::Fresh
        ]
    );
    // A run whose DDL committed but whose log entry did not.
    forget_inbox_v2(&ctx).await;
    assert_eq!(
        inbox.migrate().await.expect("the column exists: applied"),
        1
    );
    assert_eq!(inbox.migrate().await.unwrap(), 0);
    let mut tx = inbox.begin().await.unwrap();
    let got = inbox
        .register_for(&mut tx, "c", &[(fresh, AggregateKey::new("order", "o-2"))])
        .await
        .unwrap();
    inbox.rollback(tx).await.unwrap();
    assert_eq!(got, [AggregateRegistration::OtherAggregate]);
    ctx.drop().await;
}

/// The migration beside consumers of the previous version at work: short registration
/// transactions (the old INSERT) run throughout `migrate`, and every one commits.
#[tokio::test]
async fn inbox_migration_2_runs_beside_registering_consumers() {
    let ctx = ctx!(8);
    let inbox = ctx.inbox().await;
    back_to_inbox_v1(&ctx).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let (pool, table, stop) = (
                ctx.pool.clone(),
                ctx.table("processed_events"),
                stop.clone(),
            );
            tokio::spawn(async move {
                let mut done = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || done < 20 {
                    let mut tx = pool.begin().await.expect("begin");
                    sqlx::query(&format!(
                        "INSERT INTO {table} (consumer, event_id, processed_at) \
                         VALUES (?, ?, UTC_TIMESTAMP(6))"
                    ))
                    .bind(format!("c{w}"))
                    .bind(EventId::now_v7().as_uuid())
                    .execute(&mut *tx)
                    .await
                    .expect("an old consumer's registration");
                    tx.commit().await.expect("commit");
                    done += 1;
                }
                done
            })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(inbox.migrate().await.unwrap(), 1);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0i64;
    for w in workers {
        total += i64::from(w.await.unwrap());
    }
    let rows: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE aggregate IS NULL",
        ctx.table("processed_events")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(rows, total, "every registration committed");
    ctx.drop().await;
}

/// A transaction a client left open on the inbox table holds the table's metadata lock: the
/// migration's `ALTER TABLE` gives up after `MIGRATION_DDL_WAIT_SECS` with a transient
/// `Conflict` (instead of waiting the server's default of a year with every consumer's
/// statement queued behind it), and a consumer's registration that queued behind it commits.
/// Once the transaction ends, the migration applies. The connection goes back to the pool
/// with the server's lock wait.
#[tokio::test]
async fn an_open_transaction_makes_the_migration_give_up_not_stall_consumers() {
    let ctx = ctx!(4);
    ctx.inbox().await;
    back_to_inbox_v1(&ctx).await;
    let one = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&outbox_test_support::mysql_url("outbox-mysql tests").unwrap())
        .await
        .unwrap();
    let inbox = outbox_mysql::MySqlInboxStore::builder(one.clone())
        .database(&ctx.database)
        .build()
        .unwrap();
    let insert = format!(
        "INSERT INTO {} (consumer, event_id, processed_at) VALUES (?, ?, UTC_TIMESTAMP(6))",
        ctx.table("processed_events")
    );
    let mut open = ctx.pool.begin().await.unwrap();
    sqlx::query(&insert)
        .bind("stuck")
        .bind(EventId::now_v7().as_uuid())
        .execute(&mut *open)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let migrating = tokio::spawn(async move { inbox.migrate().await });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let queued = {
        let (pool, insert) = (ctx.pool.clone(), insert.clone());
        tokio::spawn(async move {
            sqlx::query(&insert)
                .bind("c")
                .bind(EventId::now_v7().as_uuid())
                .execute(&pool)
                .await
        })
    };
    let err = migrating
        .await
        .unwrap()
        .expect_err("the ALTER cannot get its lock");
    let waited = started.elapsed().as_secs_f64();
    assert_eq!(err.kind, outbox_core::StoreErrorKind::Conflict, "{err}");
    assert_eq!(err.class, outbox_core::ErrorClass::Transient, "{err}");
    let bound = f64::from(outbox_mysql::MIGRATION_DDL_WAIT_SECS);
    assert!(waited >= bound - 0.5 && waited < bound + 5.0, "{waited} s");
    queued
        .await
        .unwrap()
        .expect("the queued registration commits");
    let lock_wait: u64 = sqlx::query_scalar("SELECT @@SESSION.lock_wait_timeout")
        .fetch_one(&one)
        .await
        .unwrap();
    let default: u64 = sqlx::query_scalar("SELECT @@GLOBAL.lock_wait_timeout")
        .fetch_one(&one)
        .await
        .unwrap();
    assert_eq!(
        lock_wait, default,
        "the pooled session has the server's lock wait again"
    );
    open.commit().await.unwrap();
    let inbox = ctx.inbox().await;
    assert_eq!(inbox.migrate().await.unwrap(), 0, "applied by ctx.inbox()");
    one.close().await;
    ctx.drop().await;
}
