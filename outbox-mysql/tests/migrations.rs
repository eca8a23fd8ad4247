//! Upgrades of a database migrated by an earlier version of this crate, beside processes of
//! that version: inbox migration 2 (registrations keep their aggregate).
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
