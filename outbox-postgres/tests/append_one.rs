//! The append of a single event has its own statement (`OutboxSql::append_one`, `VALUES`
//! instead of `UNNEST`): it must write exactly the row a batch writes for the same event, and
//! date it by its statement, not by its transaction.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`.

mod common;

use outbox_core::ClaimMode;
use outbox_core::Envelope;
use sqlx::Row;

/// `e` under another aggregate id, every other field equal (its own event id).
fn twin(e: &Envelope, agg: &str) -> Envelope {
    let mut t = Envelope::builder(
        e.aggregate_type.clone(),
        agg,
        e.aggregate_version,
        e.event_type.clone(),
    )
    .payload(e.payload.clone())
    .schema_version(e.schema_version)
    .created_at(e.created_at);
    for (k, v) in &e.headers {
        t = t.header(k.clone(), v.clone());
    }
    t.build().unwrap()
}

/// Every column of the row of `agg` as JSON, without those that must differ between two
/// appends (id, event id, aggregate id, the statement's clock).
async fn row_of(ctx: &common::Ctx, agg: &str) -> serde_json::Value {
    sqlx::query(&format!(
        "SELECT to_jsonb(t) - 'id' - 'event_id' - 'aggregate_id' - 'inserted_at' AS r \
           FROM \"{}\".outbox_events t WHERE aggregate_id = $1",
        ctx.schema
    ))
    .bind(agg)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
    .get("r")
}

#[tokio::test]
async fn one_event_writes_the_row_a_batch_writes() {
    let ctx = ctx!(4);
    for mode in [ClaimMode::LockedTransaction, common::lease(30.0)] {
        let store = ctx.store(mode).await;
        let tag = format!("{mode:?}");
        let one = Envelope::builder("order", format!("one-{tag}"), 7, "order.changed")
            .json(&serde_json::json!({ "v": 7, "s": "é\u{2028}" }))
            .unwrap()
            .schema_version(3)
            .header("x-test", "1")
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .build()
            .unwrap();
        let many = twin(&one, &format!("many-{tag}"));
        // One transaction, so that the defaults taken from `now()` are equal.
        let mut tx = ctx.pool.begin().await.unwrap();
        store.append(&mut *tx, &one).await.unwrap();
        store
            .append_many(
                &mut *tx,
                &[many.clone(), common::event(&format!("x-{tag}"), 1)],
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let (a, b) = (
            row_of(&ctx, &one.aggregate_id).await,
            row_of(&ctx, &many.aggregate_id).await,
        );
        assert_eq!(a, b, "{tag}: one event's row differs from the batch's");
        assert_eq!(a["payload"], b["payload"]);
        let headers: serde_json::Value = serde_json::to_value(&one.headers).unwrap();
        assert_eq!(a["headers"], headers, "{tag}: headers as the envelope's");
        assert_eq!(a["status"], "pending", "{tag}");
        assert_eq!(a["blocked"], false, "{tag}");
    }
    ctx.drop().await;
}

/// `inserted_at` (what the stats and the backpressure gate age events from) is the append
/// statement's clock: an event appended late in a long transaction is not as old as it.
#[tokio::test]
async fn one_event_is_dated_by_its_statement_not_its_transaction() {
    let ctx = ctx!(2);
    let store = ctx.store(ClaimMode::LockedTransaction).await;
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_sleep(0.3)")
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .append(&mut *tx, &common::event("late", 1))
        .await
        .unwrap();
    let after_start_ms: f64 = sqlx::query_scalar(&format!(
        "SELECT (extract(epoch FROM inserted_at - now()) * 1000)::float8 \
           FROM \"{}\".outbox_events WHERE aggregate_id = 'late'",
        ctx.schema
    ))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(
        after_start_ms >= 250.0,
        "inserted_at is {after_start_ms} ms after the transaction's start, not the statement's \
         time (300 ms later)"
    );
    ctx.drop().await;
}
