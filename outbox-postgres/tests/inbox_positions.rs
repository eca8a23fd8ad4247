//! Inbox migration 5 (parked messages keep their transport's own position, docs/transports.md
//! §3) on a parked table of version 4: a row parked before reads back as the Kafka position it
//! was read as then, the new columns hold each transport's identity, and columns that do not
//! describe a position are refused instead of guessed.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::{
    InboxParking, InboxStore, LogPosition, NativePosition, NewParkedMessage, ParkAs, ParkKind,
    ParkedFilter, ParkedRecord, Parking, StoreErrorKind,
};
use sqlx::Row;

const INBOX_V1_TO_V4: [&str; 4] = [
    include_str!("../src/migrations/0001_inbox.sql"),
    include_str!("../src/migrations/0002_inbox.sql"),
    include_str!("../src/migrations/0003_inbox.sql"),
    include_str!("../src/migrations/0004_inbox.sql"),
];

/// The inbox of `ctx`'s schema at version 4, its migration log saying so, with one message a
/// consumer of version 4 parked at `orders/2@41`.
async fn version_4_with_a_parked_row(ctx: &common::Ctx) {
    let sql: String = INBOX_V1_TO_V4
        .iter()
        .map(|m| {
            m.replace("__SCHEMA__", &ctx.schema)
                .replace("__TABLE__", "processed_events")
        })
        .collect();
    sqlx::raw_sql(&sql).execute(&ctx.pool).await.unwrap();
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{0}\".outbox_schema_migrations (object text NOT NULL, \
           version integer NOT NULL, description text NOT NULL, \
           applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (object, version)); \
         INSERT INTO \"{0}\".outbox_schema_migrations (object, version, description) VALUES \
           ('inbox:processed_events', 1, 'v1'), ('inbox:processed_events', 2, 'v2'), \
           ('inbox:processed_events', 3, 'v3'), ('inbox:processed_events', 4, 'v4'); \
         INSERT INTO \"{0}\".processed_events_parked (consumer, topic, \"partition\", \"offset\", \
           header_names, header_values, value, status, kind, reason, attempts) \
         VALUES ('old', 'orders', 2, 41, '{{}}', '{{}}', '\\x0102', 'parked', 'unprocessable', \
           'parked by version 4', 1);",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_row_parked_before_migration_5_reads_back_as_its_kafka_position() {
    let ctx = ctx!(4);
    version_4_with_a_parked_row(&ctx).await;
    let inbox = outbox_postgres::PostgresInboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .build()
        .unwrap();
    assert_eq!(inbox.migrate().await.unwrap(), 1, "migration 5 alone");
    assert_eq!(inbox.migrate().await.unwrap(), 0, "applied once");
    let old = inbox
        .list_parked("old", &ParkedFilter::open())
        .await
        .unwrap();
    assert_eq!(old.len(), 1);
    assert_eq!(old[0].record.position, LogPosition::new("orders", 2, 41));
    assert_eq!(old[0].record.position.native, NativePosition::Log);
    assert_eq!(old[0].reason, "parked by version 4");

    // New rows name their transport in typed columns.
    let positions = [
        LogPosition::new("orders", 1, 7),
        LogPosition::jetstream("ORDERS", 42, 3, "billing"),
        LogPosition::rabbitmq("orders-q", 9, "outbox", "order.created", true),
    ];
    let mut tx = inbox.begin().await.unwrap();
    let parked = inbox
        .park(
            &mut tx,
            "new",
            &positions
                .iter()
                .map(|p| {
                    NewParkedMessage::new(
                        ParkedRecord::new(p.clone(), None, vec![], Some(vec![0xff])),
                        ParkAs::Head(ParkKind::Unprocessable),
                        "test",
                        1,
                    )
                })
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
    assert!(
        parked.iter().all(|p| matches!(p, Parking::Head(_))),
        "{parked:?}"
    );
    let rows = sqlx::query(&format!(
        "SELECT native_transport, native_sequence, native_consumer, native_exchange, \
                native_routing_key, native_redelivered \
         FROM \"{}\".processed_events_parked WHERE consumer = 'new' ORDER BY id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    type Cols = (
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<bool>,
    );
    let cols: Vec<Cols> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect();
    let s = |x: &str| Some(x.to_owned());
    assert_eq!(
        cols,
        vec![
            (s("kafka"), None, None, None, None, None),
            (s("nats"), Some(42), s("billing"), None, None, None),
            (
                s("rabbitmq"),
                None,
                None,
                s("outbox"),
                s("order.created"),
                Some(true)
            ),
        ]
    );
    let back = inbox
        .list_parked("new", &ParkedFilter::open())
        .await
        .unwrap();
    assert_eq!(
        back.iter()
            .map(|m| m.record.position.clone())
            .collect::<Vec<_>>(),
        positions
    );
    ctx.drop().await;
}

/// Columns a transport needs that are missing, or a transport this version does not know,
/// are a schema error naming the problem, never a position guessed from the rest.
#[tokio::test]
async fn native_columns_that_describe_no_position_are_refused() {
    let ctx = ctx!(4);
    let inbox = ctx.inbox().await;
    let cases = [
        ("native_transport = 'mqtt'", "unknown transport"),
        (
            "native_transport = 'nats', native_consumer = 'd'",
            "stream sequence",
        ),
        (
            "native_transport = 'nats', native_sequence = -1, native_consumer = 'd'",
            "negative stream sequence",
        ),
        (
            "native_transport = 'rabbitmq', native_exchange = 'x', native_redelivered = false",
            "routing key",
        ),
    ];
    for (i, (set, expected)) in cases.iter().enumerate() {
        let consumer = format!("bad{i}");
        sqlx::raw_sql(&format!(
            "INSERT INTO \"{0}\".processed_events_parked (consumer, topic, \"partition\", \
               \"offset\", header_names, header_values, status, kind, reason, attempts) \
             VALUES ('{consumer}', 't', 0, 1, '{{}}', '{{}}', 'parked', 'unprocessable', 'x', 1); \
             UPDATE \"{0}\".processed_events_parked SET {set} WHERE consumer = '{consumer}';",
            ctx.schema
        ))
        .execute(&ctx.pool)
        .await
        .unwrap();
        let err = inbox
            .list_parked(&consumer, &ParkedFilter::open())
            .await
            .expect_err(expected);
        assert_eq!(err.kind, StoreErrorKind::Schema, "{err}");
        assert!(err.to_string().contains(expected), "{expected}: {err}");
    }
    ctx.drop().await;
}
