//! Shared by the lease adversary tests: reading a row's status and fence, a pool whose
//! database clock is frozen, and the setups several of them start from.

use chrono::NaiveDateTime;
use outbox_core::prelude::*;
use outbox_core::{ClaimedBatch, Envelope, EventId};
use outbox_mysql::MySqlOutboxStore;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::MySqlPool;
use uuid::Uuid;

use super::{claim, park, Ctx};

/// The event ids of a batch, in order.
pub fn ids(batch: &ClaimedBatch) -> Vec<EventId> {
    batch.records.iter().map(|r| r.envelope.event_id).collect()
}

/// (status, park kind) of the row of `e`.
pub async fn status_of(ctx: &Ctx, e: &Envelope) -> (String, Option<String>) {
    sqlx::query_as(&format!(
        "SELECT CAST(status AS CHAR), CAST(park_kind AS CHAR) FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// (claim token, `next_attempt_at`) of the row of `e`.
pub async fn fence_of(ctx: &Ctx, e: &Envelope) -> (Uuid, NaiveDateTime) {
    sqlx::query_as(&format!(
        "SELECT claim_token, next_attempt_at FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A pool of one connection whose session clock is frozen at `at` (UTC): every
/// `UTC_TIMESTAMP(6)` on it reads `at`.
pub async fn frozen_at(at: NaiveDateTime) -> MySqlPool {
    let url =
        std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let us = at.and_utc().timestamp_micros();
    MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                sqlx::query(&format!(
                    "SET time_zone = '+00:00', timestamp = {}.{:06}",
                    us / 1_000_000,
                    us % 1_000_000
                ))
                .execute(conn)
                .await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap()
}

/// Two copies of one version: `leased` inserted first (the lower id) in a transaction left
/// open while `copy` is appended, claimed by `relay-1` and parked; then `leased` commits, the
/// aggregate's pending head below the parked copy, not yet claimed.
pub async fn park_a_copy_beside_its_uncommitted_twin(
    ctx: &Ctx,
    s: &MySqlOutboxStore,
    copy: &Envelope,
    leased: &Envelope,
) {
    let mut tx = ctx.pool.begin().await.unwrap();
    s.append_many_in(&mut tx, std::slice::from_ref(leased))
        .await
        .unwrap();
    super::append(ctx, s, std::slice::from_ref(copy)).await;
    let c = claim(s, "relay-1", 10).await;
    assert_eq!(ids(&c), vec![copy.event_id]);
    let rep = s.complete(&c.handle, &[park(copy)]).await.unwrap();
    assert_eq!(rep.applied, 1);
    tx.commit().await.unwrap();
}
