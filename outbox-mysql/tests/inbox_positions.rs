//! Inbox migration 4 (parked messages keep their transport's own position, docs/transports.md
//! §3) on a parked table of version 3: a row parked before reads back as the Kafka position it
//! was read as then, the new columns hold each transport's identity, and columns that do not
//! describe a position are refused instead of guessed.
//!
//! Each test has its own database on the server at `MYSQL_URL`.

mod common;

use outbox_core::{
    InboxParking, InboxStore, LogPosition, NativePosition, NewParkedMessage, ParkAs, ParkKind,
    ParkedFilter, ParkedRecord, Parking, StoreErrorKind,
};
use outbox_mysql::MySqlInboxStore;
use sqlx::Row;

async fn park(inbox: &MySqlInboxStore, consumer: &str, positions: &[LogPosition]) {
    let mut tx = inbox.begin().await.unwrap();
    let parked = inbox
        .park(
            &mut tx,
            consumer,
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
}

/// Turns the parked table of `ctx` back into its migration-3 shape (the native columns gone,
/// the migration log at version 3): the rows in it are what a consumer of version 3 wrote.
async fn back_to_inbox_v3(ctx: &common::Ctx) {
    sqlx::query(&format!(
        "ALTER TABLE {} DROP COLUMN native_transport, DROP COLUMN native_sequence, \
           DROP COLUMN native_consumer, DROP COLUMN native_exchange, \
           DROP COLUMN native_routing_key, DROP COLUMN native_redelivered",
        ctx.table("processed_events_parked")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "DELETE FROM {} WHERE object = 'inbox:processed_events' AND version >= 4",
        ctx.table("outbox_schema_migrations")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_row_parked_before_migration_4_reads_back_as_its_kafka_position() {
    let ctx = ctx!(4);
    let inbox = ctx.inbox().await;
    park(&inbox, "old", &[LogPosition::new("orders", 2, 41)]).await;
    back_to_inbox_v3(&ctx).await;
    assert_eq!(inbox.migrate().await.unwrap(), 1, "migration 4 alone");
    assert_eq!(inbox.migrate().await.unwrap(), 0, "applied once");
    let old = inbox
        .list_parked("old", &ParkedFilter::open())
        .await
        .unwrap();
    assert_eq!(old.len(), 1);
    assert_eq!(old[0].record.position, LogPosition::new("orders", 2, 41));
    assert_eq!(old[0].record.position.native, NativePosition::Log);
    let transport: Option<String> = sqlx::query_scalar(&format!(
        "SELECT native_transport FROM {} WHERE consumer = 'old'",
        ctx.table("processed_events_parked")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(transport, None, "the row was not rewritten");

    // New rows name their transport in typed columns.
    let positions = [
        LogPosition::new("orders", 1, 7),
        LogPosition::jetstream("ORDERS", 42, 3, "billing"),
        LogPosition::rabbitmq("orders-q", 9, "outbox", "order.created", true),
    ];
    park(&inbox, "new", &positions).await;
    let rows = sqlx::query(&format!(
        "SELECT native_transport, native_sequence, native_consumer, native_exchange, \
                native_routing_key, native_redelivered \
         FROM {} WHERE consumer = 'new' ORDER BY id",
        ctx.table("processed_events_parked")
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
    let text = |r: &sqlx::mysql::MySqlRow, i: usize| {
        r.get::<Option<Vec<u8>>, _>(i)
            .map(|b| String::from_utf8(b).unwrap())
    };
    let cols: Vec<Cols> = rows
        .iter()
        .map(|r| {
            (
                text(r, 0),
                r.get(1),
                text(r, 2),
                text(r, 3),
                text(r, 4),
                r.get(5),
            )
        })
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
            "native_transport = 'rabbitmq', native_exchange = 'x', native_redelivered = 0",
            "routing key",
        ),
    ];
    for (i, (set, expected)) in cases.iter().enumerate() {
        let consumer = format!("bad{i}");
        park(&inbox, &consumer, &[LogPosition::new("t", 0, 1)]).await;
        sqlx::query(&format!(
            "UPDATE {} SET {set} WHERE consumer = ?",
            ctx.table("processed_events_parked")
        ))
        .bind(&consumer)
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
