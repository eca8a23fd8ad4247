//! Outbox migration 2 (transport-neutral acknowledgements, docs/transports.md §2) on a
//! database of migration 1 with rows in every state: what a relay of the previous version
//! published reads back as Kafka acknowledgements, the rewritten CHECK refuses a published row
//! without a complete acknowledgement of its transport, the migration runs again after a run
//! that failed before it was logged, and both claim modes write each transport's own form.
//!
//! Each test has its own database on the server at `MYSQL_URL`.

mod common;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, PublishedFilter};
use outbox_testkit::store_checks;
use sqlx::Row;

use common::{append, claim, event, lease, park};

/// The outbox as migration 1 created it (its SQL file, as embedded), logged at version 1.
async fn version_1_schema(ctx: &common::Ctx) {
    sqlx::query(&format!(
        "CREATE DATABASE IF NOT EXISTS `{}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
        ctx.database
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let sql = include_str!("../src/migrations/0001_outbox.sql")
        .replace("__Q__", &format!("`{}`.", ctx.database))
        .replace("__TABLE__", "outbox_events");
    let sql: String = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    for stmt in sql.split(";\n").map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::raw_sql(stmt.trim_end_matches(';'))
            .execute(&ctx.pool)
            .await
            .unwrap_or_else(|e| panic!("{stmt}: {e}"));
    }
    sqlx::query(&format!(
        "CREATE TABLE {} (object VARCHAR(255) NOT NULL, version INT NOT NULL, \
           description TEXT NOT NULL, applied_at DATETIME(6) NOT NULL, \
           PRIMARY KEY (object, version))",
        ctx.table("outbox_schema_migrations")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} VALUES ('outbox:outbox_events', 1, 'v1', UTC_TIMESTAMP(6))",
        ctx.table("outbox_schema_migrations")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// Rows as a relay of the previous version left them: published ones with (topic, partition,
/// offset), one parked, one discarded, one pending, one published row archived by cleanup.
async fn version_1_rows(ctx: &common::Ctx) {
    version_1_schema(ctx).await;
    let store = ctx.builder(lease(30.0)).build().unwrap();
    let events: Vec<_> = ["p1", "p2", "parked", "discarded", "pending", "archived"]
        .iter()
        .map(|a| event(a, 1))
        .collect();
    append(ctx, &store, &events).await;
    let t = ctx.table("outbox_events");
    for stmt in [
        format!(
            "UPDATE {t} SET status = 'published', published_at = UTC_TIMESTAMP(6), \
                finished_at = UTC_TIMESTAMP(6), ack_topic = 'orders', ack_partition = 3, \
                ack_offset = CASE aggregate_id WHEN 'p1' THEN 41 ELSE 42 END \
             WHERE aggregate_id IN ('p1', 'p2', 'archived')"
        ),
        format!(
            "UPDATE {t} SET status = 'parked', parked_at = UTC_TIMESTAMP(6), \
                park_kind = 'permanent_error', last_error_class = 'permanent', \
                last_error_kind = 'record_too_large', last_error_message = 'big' \
             WHERE aggregate_id IN ('parked', 'discarded')"
        ),
        format!(
            "UPDATE {t} SET status = 'discarded', finished_at = UTC_TIMESTAMP(6), \
                discard_reason = 'ops' WHERE aggregate_id = 'discarded'"
        ),
        format!(
            "INSERT INTO {} (id, event_id, aggregate_type, aggregate_id, aggregate_key, \
                aggregate_version, event_type, schema_version, content_type, payload, headers, \
                created_at, status, attempts, maybe_delivered, published_at, ack_topic, \
                ack_partition, ack_offset, finished_at, inserted_at, archived_at) \
             SELECT id, event_id, aggregate_type, aggregate_id, aggregate_key, \
                aggregate_version, event_type, schema_version, content_type, payload, headers, \
                created_at, status, attempts, maybe_delivered, published_at, ack_topic, \
                ack_partition, ack_offset, finished_at, inserted_at, UTC_TIMESTAMP(6) \
             FROM {t} WHERE aggregate_id = 'archived'",
            ctx.table("outbox_events_archive")
        ),
        format!("DELETE FROM {t} WHERE aggregate_id = 'archived'"),
    ] {
        sqlx::query(&stmt)
            .execute(&ctx.pool)
            .await
            .unwrap_or_else(|e| panic!("{stmt}: {e}"));
    }
}

type AckRow = (String, Option<String>, Option<String>, Option<i64>);

async fn acks_by_aggregate(ctx: &common::Ctx, table: &str) -> Vec<AckRow> {
    sqlx::query(&format!(
        "SELECT CAST(aggregate_id AS CHAR), CAST(ack_transport AS CHAR), \
                CAST(ack_destination AS CHAR), ack_position \
         FROM {} ORDER BY aggregate_id",
        ctx.table(table)
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

async fn check_upgraded(ctx: &common::Ctx) {
    let s = |v: &str| Some(v.to_owned());
    assert_eq!(
        acks_by_aggregate(ctx, "outbox_events").await,
        vec![
            ("discarded".into(), None, None, None),
            ("p1".into(), s("kafka"), s("orders"), Some(41)),
            ("p2".into(), s("kafka"), s("orders"), Some(42)),
            ("parked".into(), None, None, None),
            ("pending".into(), None, None, None),
        ],
        "published rows are Kafka acknowledgements; rows without one name no transport"
    );
    assert_eq!(
        acks_by_aggregate(ctx, "outbox_events_archive").await,
        vec![("archived".into(), s("kafka"), s("orders"), Some(42))],
        "the archive too"
    );
}

#[tokio::test]
async fn rows_published_under_migration_1_read_back_as_kafka_acknowledgements() {
    let ctx = ctx!(4);
    version_1_rows(&ctx).await;
    let store = ctx.builder(lease(30.0)).build().unwrap();
    assert_eq!(
        store.migrate().await.unwrap(),
        3,
        "migrations 2, 3 and 4 run"
    );
    assert_eq!(store.migrate().await.unwrap(), 0, "and only once");
    check_upgraded(&ctx).await;
    let rows = store
        .published_events(&PublishedFilter::default(), None, 10)
        .await
        .unwrap();
    let acks: Vec<_> = rows
        .iter()
        .map(|r| (r.envelope.aggregate_id.clone(), r.ack.to_string()))
        .collect();
    assert_eq!(
        acks,
        [
            ("p1".into(), "orders/3@41".into()),
            ("p2".into(), "orders/3@42".to_owned())
        ],
    );

    // A run that failed after the DDL of migration 2 (the log not written, so neither the
    // later ones) runs again without error.
    sqlx::query(&format!(
        "DELETE FROM {} WHERE object = 'outbox:outbox_events' AND version >= 2",
        ctx.table("outbox_schema_migrations")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        store.migrate().await.unwrap(),
        3,
        "migrations 2, 3 and 4 run again"
    );
    check_upgraded(&ctx).await;

    // A new row names its transport itself: the default that filled the old rows is gone.
    let default: Option<String> = sqlx::query_scalar(
        "SELECT CAST(column_default AS CHAR) FROM information_schema.columns \
         WHERE table_schema = ? AND table_name = 'outbox_events' \
           AND column_name = 'ack_transport'",
    )
    .bind(&ctx.database)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert!(
        default.is_none() || default.as_deref() == Some("NULL"),
        "{default:?}"
    );

    // The pending row is claimed, published over JetStream and reads back as such.
    store_checks::pending_row_reads_back_a_jetstream_ack(&store).await;
    ctx.drop().await;
}

/// The rewritten CHECK: a published row needs its transport, its destination and what its
/// transport stores. An unknown transport written by hand is refused on read.
#[tokio::test]
async fn the_check_refuses_a_published_row_without_a_complete_acknowledgement() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    append(&ctx, &store, &[event("a", 1)]).await;
    let publish = |set: &str| {
        format!(
            "UPDATE {} SET status = 'published', published_at = UTC_TIMESTAMP(6), \
                finished_at = UTC_TIMESTAMP(6), {set}",
            ctx.table("outbox_events")
        )
    };
    let refused = [
        "ack_transport = NULL, ack_destination = NULL",
        "ack_transport = NULL, ack_destination = 'orders', ack_partition = 0, ack_position = 1",
        "ack_transport = 'kafka', ack_destination = NULL, ack_partition = 0, ack_position = 1",
        "ack_transport = 'kafka', ack_destination = 'orders', ack_partition = NULL, ack_position = 1",
        "ack_transport = 'kafka', ack_destination = 'orders', ack_partition = 0",
        "ack_transport = 'nats', ack_destination = 'S', ack_route = 's', ack_duplicate = 0",
        "ack_transport = 'nats', ack_destination = 'S', ack_position = 1, ack_duplicate = 0",
        "ack_transport = 'nats', ack_destination = 'S', ack_position = 1, ack_route = 's'",
        "ack_transport = 'rabbitmq', ack_destination = 'x'",
    ];
    for set in refused {
        let err = sqlx::query(&publish(set))
            .execute(&ctx.pool)
            .await
            .expect_err(set);
        let code = err
            .as_database_error()
            .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .map(sqlx::mysql::MySqlDatabaseError::number);
        // MySQL 3819, MariaDB 4025: a CHECK constraint failed.
        assert!(matches!(code, Some(3819 | 4025)), "{set}: {err}");
    }
    let accepted = [
        "ack_transport = 'kafka', ack_destination = 'orders', ack_partition = 0, ack_position = 1",
        "ack_transport = 'nats', ack_destination = 'S', ack_position = 1, ack_route = 's', \
         ack_duplicate = 0, ack_partition = NULL",
        "ack_transport = 'rabbitmq', ack_destination = 'x', ack_route = '', \
         ack_position = NULL, ack_duplicate = NULL",
        "ack_transport = 'pulsar', ack_destination = 'x'",
    ];
    for set in accepted {
        sqlx::query(&publish(set))
            .execute(&ctx.pool)
            .await
            .unwrap_or_else(|e| panic!("{set}: {e}"));
    }
    store_checks::unknown_transport_is_refused_on_read(&store).await;
    ctx.drop().await;
}

/// Each transport's acknowledgement through the completion of both claim modes and back, and
/// a park writes none.
#[tokio::test]
async fn both_claim_modes_write_each_transport_acknowledgement() {
    let ctx = ctx!(4);
    for mode in [ClaimMode::LockedTransaction, lease(30.0)] {
        let store = ctx.store(mode).await;
        let acks = store_checks::transport_acks();
        let events: Vec<_> = (0..acks.len())
            .map(|k| event(&format!("{mode:?}-{k}"), 1))
            .collect();
        append(&ctx, &store, &events).await;
        store_checks::acks_read_back(&store, &events, &acks, &format!("{mode:?}")).await;
    }
    let store = ctx.store(lease(30.0)).await;
    let e = event("parked", 1);
    append(&ctx, &store, std::slice::from_ref(&e)).await;
    let batch = claim(&store, "r", 10).await;
    store.complete(&batch.handle, &[park(&e)]).await.unwrap();
    let none: (Option<String>, Option<String>) = sqlx::query_as(&format!(
        "SELECT CAST(ack_transport AS CHAR), CAST(ack_destination AS CHAR) FROM {} \
         WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(none, (None, None));
    ctx.drop().await;
}
