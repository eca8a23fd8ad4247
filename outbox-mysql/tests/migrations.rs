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
    back_to_inbox_v2(ctx).await;
    sqlx::query(&format!(
        "ALTER TABLE {} DROP COLUMN aggregate",
        ctx.table("processed_events")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    forget_inbox_v2(ctx).await;
}

/// Removes migrations 2 and later from the log (as a run that failed after migration 2's DDL
/// committed leaves it).
async fn forget_inbox_v2(ctx: &common::Ctx) {
    forget_inbox_from(ctx, 2).await;
}

/// Removes migrations `version` and later from the log.
async fn forget_inbox_from(ctx: &common::Ctx, version: i32) {
    sqlx::query(&format!(
        "DELETE FROM {} WHERE object = 'inbox:processed_events' AND version >= ?",
        ctx.table("outbox_schema_migrations")
    ))
    .bind(version)
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// Turns the inbox of `ctx` back into its migration-2 shape (parked messages unique by
/// consumer and dedup id, the migration log at version 2). The columns of migration 4 stay
/// (this version's store, which plays the previous version's consumer here, writes them), so
/// migration 4 applies again as a run whose DDL committed but whose log entry did not
/// (the conformance check
/// `a_message_parked_before_the_native_columns_reads_back_as_its_kafka_position` upgrades a
/// table without them).
async fn back_to_inbox_v2(ctx: &common::Ctx) {
    let parked = ctx.table("processed_events_parked");
    for ddl in [
        format!("ALTER TABLE {parked} ADD UNIQUE KEY dedup_key (consumer, dedup_id)"),
        format!("ALTER TABLE {parked} DROP KEY dedup_scope_key"),
        format!("ALTER TABLE {parked} DROP COLUMN dedup_scope"),
    ] {
        sqlx::query(&ddl).execute(&ctx.pool).await.unwrap();
    }
    forget_inbox_from(ctx, 3).await;
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
    assert_eq!(inbox.migrate().await.unwrap(), 3, "migrations 2 to 4 apply");
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
        3
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
    assert_eq!(inbox.migrate().await.unwrap(), 3);
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

/// The raw record of `e` at `offset` of topic `t`, as the engine parks it.
fn record_of(e: &outbox_core::Envelope, offset: i64) -> outbox_core::ParkedRecord {
    outbox_core::ParkedRecord::new(
        outbox_core::LogPosition::new("t", 0, offset),
        Some(e.aggregate_id.clone().into_bytes()),
        outbox_core::wire::encode_headers(e)
            .into_iter()
            .map(|(k, v)| outbox_core::RecordHeader::new(k, v))
            .collect(),
        Some(e.payload.bytes.clone()),
    )
}

/// Parks `record` as a head for consumer `c`, in a transaction of its own.
async fn park(
    inbox: &outbox_mysql::MySqlInboxStore,
    record: outbox_core::ParkedRecord,
) -> outbox_core::Parking {
    let mut tx = inbox.begin().await.unwrap();
    let mut p = inbox
        .park(
            &mut tx,
            "c",
            &[outbox_core::NewParkedMessage::new(
                record,
                outbox_core::ParkAs::Head(outbox_core::ParkKind::Unprocessable),
                "fails",
                1,
            )],
        )
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
    p.pop().unwrap()
}

/// Inbox migration 3 on a database of migration 2 holding parked messages of the previous
/// version: an event of `a`, an undecodable record, and an undecodable record parked under a
/// content id after a rewind (a dedup id without an aggregate). After the upgrade a record of
/// `b` naming `a`'s parked event as its original is parked (before it, it came back "parked
/// already" and was lost); the redeliveries of every message parked before the upgrade, and
/// of the new one, are parked already; and a run that failed after its DDL committed applies
/// again without error.
#[tokio::test]
async fn inbox_migration_3_scopes_the_parked_messages_of_the_previous_version() {
    use outbox_core::{wire, Envelope, LogPosition, ParkedRecord, Parking, RecordHeader};
    let ctx = ctx!(4);
    let inbox = ctx.inbox().await;
    back_to_inbox_v2(&ctx).await;
    let real = Envelope::builder("order", "a", 1, "order.changed")
        .build()
        .unwrap();
    let foreign = Envelope::builder("order", "b", 1, "order.changed")
        .header(wire::ORIGINAL_EVENT_ID, real.event_id.to_string())
        .build()
        .unwrap();
    let garbled = |offset: i64, value: u8| {
        ParkedRecord::new(
            LogPosition::new("t", 0, offset),
            None,
            vec![RecordHeader::new("garbage", vec![0xff])],
            Some(vec![value]),
        )
    };
    // The previous version's rows.
    assert!(matches!(
        park(&inbox, record_of(&real, 1)).await,
        Parking::Head(_)
    ));
    assert!(matches!(
        park(&inbox, garbled(2, 1)).await,
        Parking::Head(_)
    ));
    // Another record at offset 2 (the log was rewound): parked under its content id.
    assert!(matches!(
        park(&inbox, garbled(2, 2)).await,
        Parking::Head(_)
    ));
    assert_eq!(
        park(&inbox, record_of(&foreign, 3)).await,
        Parking::AlreadyParked,
        "the shape of migration 2 takes the foreign record for parked already"
    );
    assert_eq!(
        inbox.migrate().await.unwrap(),
        2,
        "migrations 3 and 4 apply"
    );
    let upgraded = |inbox: outbox_mysql::MySqlInboxStore| {
        let real = real.clone();
        async move {
            for (what, record) in [
                ("the event", record_of(&real, 10)),
                ("an undecodable record", garbled(2, 1)),
                ("a record parked after a rewind", garbled(2, 2)),
            ] {
                assert_eq!(
                    park(&inbox, record).await,
                    Parking::AlreadyParked,
                    "a redelivery of {what} parked before the upgrade"
                );
            }
        }
    };
    upgraded(inbox.clone()).await;
    let p = park(&inbox, record_of(&foreign, 3)).await;
    assert!(matches!(p, Parking::Head(_)), "{p:?}");
    assert_eq!(
        park(&inbox, record_of(&foreign, 4)).await,
        Parking::AlreadyParked
    );
    // A run whose DDL committed but whose log entry did not.
    forget_inbox_from(&ctx, 3).await;
    assert_eq!(inbox.migrate().await.expect("applied again"), 2);
    assert_eq!(inbox.migrate().await.unwrap(), 0);
    upgraded(inbox.clone()).await;
    let mut keys: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT CAST(index_name AS CHAR) FROM information_schema.statistics \
         WHERE table_schema = ? AND table_name = 'processed_events_parked' \
           AND non_unique = 0",
    )
    .bind(&ctx.database)
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    keys.sort();
    assert_eq!(keys, ["PRIMARY", "dedup_scope_key", "position_key"]);
    ctx.drop().await;
}
