//! Migration 8 (transport-neutral acknowledgements, docs/transports.md §2) on a table of
//! version 7 with rows in every state: what a relay of version 7 published reads back as Kafka
//! acknowledgements, the new CHECK is validated and refuses a published row without a
//! complete acknowledgement of its transport, and the store writes and reads each transport's
//! own form.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::prelude::*;
use outbox_core::{AckMetadata, ClaimMode};
use outbox_postgres::PublishedFilter;
use outbox_testkit::store_checks;
use sqlx::Row;

use common::{claim, event, lease, park};

/// Rows as a relay of version 7 left them: published ones with (topic, partition, offset),
/// one parked, one discarded, one pending, one published row archived by cleanup.
async fn version_7_rows(ctx: &common::Ctx) {
    common::schema_at_version(ctx, 7).await;
    let store = ctx.store_unmigrated(lease(30.0));
    let events: Vec<_> = ["p1", "p2", "parked", "discarded", "pending", "archived"]
        .iter()
        .map(|a| event(a, 1))
        .collect();
    store.append_many(&ctx.pool, &events).await.unwrap();
    sqlx::raw_sql(&format!(
        "UPDATE \"{0}\".outbox_events SET status = 'published', published_at = now(), \
            finished_at = now(), ack_topic = 'orders', ack_partition = 3, \
            ack_offset = CASE aggregate_id WHEN 'p1' THEN 41 ELSE 42 END \
         WHERE aggregate_id IN ('p1', 'p2', 'archived'); \
         UPDATE \"{0}\".outbox_events SET status = 'parked', parked_at = now(), \
            park_kind = 'permanent_error', last_error_class = 'permanent', \
            last_error_kind = 'record_too_large', last_error_message = 'big' \
         WHERE aggregate_id IN ('parked', 'discarded'); \
         UPDATE \"{0}\".outbox_events SET status = 'discarded', finished_at = now(), \
            discard_reason = 'ops' WHERE aggregate_id = 'discarded'; \
         WITH d AS (DELETE FROM \"{0}\".outbox_events WHERE aggregate_id = 'archived' \
                    RETURNING *) \
         INSERT INTO \"{0}\".outbox_events_archive SELECT * FROM d;",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

async fn check_valid(ctx: &common::Ctx) -> bool {
    sqlx::query_scalar(
        "SELECT convalidated FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace \
         WHERE n.nspname = $1 AND c.conname = 'outbox_events_published_has_ack'",
    )
    .bind(&ctx.schema)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

async fn acks_by_aggregate(
    ctx: &common::Ctx,
    table: &str,
) -> Vec<(String, Option<String>, Option<String>, Option<i64>)> {
    sqlx::query(&format!(
        "SELECT aggregate_id, ack_transport, ack_destination, ack_position \
         FROM \"{}\".{table} ORDER BY aggregate_id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

#[tokio::test]
async fn rows_published_under_version_7_read_back_as_kafka_acknowledgements() {
    let ctx = ctx!(4);
    version_7_rows(&ctx).await;
    let store = ctx.store_unmigrated(lease(30.0));
    assert_eq!(store.migrate().await.unwrap(), 4, "migrations 8 to 11 run");
    assert_eq!(store.migrate().await.unwrap(), 0, "and only once");

    let s = |v: &str| Some(v.to_owned());
    assert_eq!(
        acks_by_aggregate(&ctx, "outbox_events").await,
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
        acks_by_aggregate(&ctx, "outbox_events_archive").await,
        vec![("archived".into(), s("kafka"), s("orders"), Some(42))],
        "the archive too"
    );
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
    assert_eq!(rows[0].ack, AckMetadata::kafka("orders", 3, 41));

    // The CHECK is valid (validated after the migration's transaction), not left NOT VALID;
    // left NOT VALID by a crash between the two steps, the next migrate validates it.
    assert!(check_valid(&ctx).await, "published_has_ack is validated");
    let definition: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c \
           JOIN pg_namespace n ON n.oid = c.connamespace \
         WHERE n.nspname = $1 AND c.conname = 'outbox_events_published_has_ack'",
    )
    .bind(&ctx.schema)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    let definition = definition.trim_end_matches(" NOT VALID");
    sqlx::raw_sql(&format!(
        "ALTER TABLE \"{0}\".outbox_events DROP CONSTRAINT outbox_events_published_has_ack; \
         ALTER TABLE \"{0}\".outbox_events ADD CONSTRAINT outbox_events_published_has_ack \
           {definition} NOT VALID",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    assert!(!check_valid(&ctx).await);
    assert_eq!(store.migrate().await.unwrap(), 0);
    assert!(check_valid(&ctx).await, "validated by the next migrate");

    // A new row names its transport itself (the default that filled the old rows is gone).
    let default: Option<String> = sqlx::query_scalar(
        "SELECT column_default FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = 'outbox_events' \
           AND column_name = 'ack_transport'",
    )
    .bind(&ctx.schema)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(default, None);

    // The pending row is claimed, published over JetStream and reads back as such; cleanup
    // copies rows to the archive, whose columns still line up.
    store_checks::pending_row_reads_back_a_jetstream_ack(&store).await;
    ctx.drop().await;
}

/// The rewritten CHECK: a published row needs its transport, its destination and what its
/// transport stores (Kafka partition and offset; JetStream sequence, subject and duplicate
/// flag; RabbitMQ routing key). An unknown transport written by hand is refused on read.
#[tokio::test]
async fn the_check_refuses_a_published_row_without_a_complete_acknowledgement() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    store.append(&ctx.pool, &event("a", 1)).await.unwrap();
    let publish = |set: &str| {
        format!(
            "UPDATE \"{}\".outbox_events SET status = 'published', published_at = now(), \
                finished_at = now(), {set}",
            ctx.schema
        )
    };
    let refused = [
        "ack_transport = NULL, ack_destination = NULL",
        "ack_transport = NULL, ack_destination = 'orders', ack_partition = 0, ack_position = 1",
        "ack_transport = 'kafka', ack_destination = NULL, ack_partition = 0, ack_position = 1",
        "ack_transport = 'kafka', ack_destination = 'orders', ack_partition = NULL, ack_position = 1",
        "ack_transport = 'kafka', ack_destination = 'orders', ack_partition = 0",
        "ack_transport = 'nats', ack_destination = 'S', ack_route = 's', ack_duplicate = false",
        "ack_transport = 'nats', ack_destination = 'S', ack_position = 1, ack_duplicate = false",
        "ack_transport = 'nats', ack_destination = 'S', ack_position = 1, ack_route = 's'",
        "ack_transport = 'rabbitmq', ack_destination = 'x'",
    ];
    for set in refused {
        let err = sqlx::raw_sql(&publish(set))
            .execute(&ctx.pool)
            .await
            .expect_err(set);
        let code = err
            .as_database_error()
            .and_then(|d| d.code().map(|c| c.into_owned()));
        assert_eq!(code.as_deref(), Some("23514"), "{set}: {err}");
    }
    let accepted = [
        "ack_transport = 'kafka', ack_destination = 'orders', ack_partition = 0, ack_position = 1",
        "ack_transport = 'nats', ack_destination = 'S', ack_position = 1, ack_route = 's', \
         ack_duplicate = false, ack_partition = NULL",
        "ack_transport = 'rabbitmq', ack_destination = 'x', ack_route = '', \
         ack_position = NULL, ack_duplicate = NULL",
        // Another transport than the three: accepted by the CHECK, refused on read.
        "ack_transport = 'pulsar', ack_destination = 'x'",
    ];
    for set in accepted {
        sqlx::raw_sql(&publish(set))
            .execute(&ctx.pool)
            .await
            .unwrap_or_else(|e| panic!("{set}: {e}"));
    }
    store_checks::unknown_transport_is_refused_on_read(&store).await;
    ctx.drop().await;
}

/// Each transport's acknowledgement through the completion statements of both claim modes
/// and back: the columns a relay writes are the columns replay reads.
#[tokio::test]
async fn both_claim_modes_write_each_transport_acknowledgement() {
    let ctx = ctx!(4);
    for mode in [ClaimMode::LockedTransaction, lease(30.0)] {
        let store = ctx.store(mode).await;
        let acks = store_checks::transport_acks();
        let events: Vec<_> = (0..acks.len())
            .map(|k| event(&format!("{mode:?}-{k}"), 1))
            .collect();
        store.append_many(&ctx.pool, &events).await.unwrap();
        store_checks::acks_read_back(&store, &events, &acks, &format!("{mode:?}")).await;
    }
    // A park writes no acknowledgement (and no transport).
    let store = ctx.store(lease(30.0)).await;
    let e = event("parked", 1);
    store.append(&ctx.pool, &e).await.unwrap();
    let batch = claim(&store, "r", 10).await;
    store.complete(&batch.handle, &[park(&e)]).await.unwrap();
    let none: (Option<String>, Option<String>) = sqlx::query_as(&format!(
        "SELECT ack_transport, ack_destination FROM \"{}\".outbox_events WHERE event_id = $1",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(none, (None, None));
    ctx.drop().await;
}
