//! Adversary pass on issue 20, item 6: aggregate names bounded to `MAX_AGGREGATE_NAME_BYTES`
//! bytes, and a stored event past the bound parked by the claim before any state is written.
//! Attacked here: such events written by plain SQL (as a producer in another language would)
//! between ordinary ones of one claim batch, in both claim modes and with
//! `accept_first_version`; the type as well as the id; multibyte names exactly at the bound
//! and one character past it (bytes, not characters); operator actions on them.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, Envelope, EnvelopeLimits, ParkKind, StoreErrorKind, MAX_AGGREGATE_NAME_BYTES,
};
use outbox_postgres::PostgresOutboxStore;

use common::{claim, lease, publish_all};

fn store_with(ctx: &common::Ctx, mode: ClaimMode, accept_first: bool) -> PostgresOutboxStore {
    PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(accept_first)
        .limits(EnvelopeLimits::default().with_max_name_len(4096))
        .build()
        .unwrap()
}

fn ev(agg_type: &str, agg_id: &str, version: i64) -> Envelope {
    Envelope::builder(agg_type, agg_id, version, "order.changed")
        .limits(EnvelopeLimits::unlimited())
        .json(&serde_json::json!({ "v": version }))
        .unwrap()
        .build()
        .unwrap()
}

/// Inserts `e` with plain SQL, as a producer that does not go through this crate would.
async fn insert_raw(ctx: &common::Ctx, e: &Envelope) {
    sqlx::query(&format!(
        "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
           aggregate_version, event_type, schema_version, content_type, payload, created_at) \
         VALUES ($1, $2, $3, $4, $5, 1, 'application/json', $6, now())",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .bind(&e.aggregate_type)
    .bind(&e.aggregate_id)
    .bind(e.aggregate_version)
    .bind(&e.event_type)
    .bind(&e.payload.bytes)
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// `prefix`, then three-byte characters and single bytes up to exactly `bytes` bytes.
fn exactly(prefix: &str, bytes: usize) -> String {
    let rest = bytes - prefix.len();
    format!("{prefix}{}{}", "€".repeat(rest / 3), "a".repeat(rest % 3))
}

/// Rows of the state table whose names are past the bound (must stay 0).
async fn unkeyable_states(ctx: &common::Ctx) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events_aggregate \
          WHERE octet_length(aggregate_type) > $1 OR octet_length(aggregate_id) > $1",
        ctx.schema
    ))
    .bind(i32::try_from(MAX_AGGREGATE_NAME_BYTES).unwrap())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A claim batch of ordinary events with over-long ones (id past the bound by one multibyte
/// character, type past it, both starting at version 3 so that `accept_first_version` matters)
/// inserted between them, in both modes, with and without `accept_first_version`: the claim
/// hands out exactly the ordinary heads, parks the over-long ones as permanent errors without
/// writing state for them, and their later versions are parked when reached; operators can only
/// discard them; names exactly at the bound in multibyte characters flow.
#[tokio::test]
async fn over_long_names_between_ordinary_events_of_one_batch() {
    let ctx = ctx!(6);
    // Three-byte characters up to exactly the bound; one two-byte character past it.
    let at_bound = exactly("", MAX_AGGREGATE_NAME_BYTES);
    let past_bound = format!("{at_bound}é");
    for accept in [false, true] {
        for mode in [lease(30.0), ClaimMode::LockedTransaction] {
            let store = store_with(&ctx, mode, accept);
            store.migrate().await.unwrap();
            let tag = format!("{accept}-{}", matches!(mode, ClaimMode::Lease { .. }));
            let first = if accept { 3 } else { 1 };
            let ok_a = ev("order", &format!("{tag}-a"), first);
            let long_id = ev("order", &format!("{tag}{past_bound}"), first);
            let id_at_bound = exactly(&tag, MAX_AGGREGATE_NAME_BYTES);
            assert_eq!(id_at_bound.len(), MAX_AGGREGATE_NAME_BYTES);
            let ok_b = ev(&at_bound, &id_at_bound, first);
            let long_type = ev(&format!("{past_bound}{tag}"), "x", first);
            let ok_c = ev("order", &format!("{tag}-c"), first);
            let long_id_next = ev("order", &format!("{tag}{past_bound}"), first + 1);
            // Interleaved in id order: ok, long, ok (at the bound), long, ok, long's next.
            store.append(&ctx.pool, &ok_a).await.unwrap();
            insert_raw(&ctx, &long_id).await;
            store.append(&ctx.pool, &ok_b).await.unwrap();
            insert_raw(&ctx, &long_type).await;
            store.append(&ctx.pool, &ok_c).await.unwrap();
            insert_raw(&ctx, &long_id_next).await;
            // The store refuses to append one of them itself.
            let refused = store
                .append(&ctx.pool, &ev("order", &past_bound, 1))
                .await
                .unwrap_err();
            assert_eq!(refused.kind, StoreErrorKind::Validation, "{tag}");

            let b = claim(&store, "r", 10).await;
            let mut got: Vec<_> = b.records.iter().map(|r| r.envelope.event_id).collect();
            got.sort();
            let mut want = vec![ok_a.event_id, ok_b.event_id, ok_c.event_id];
            want.sort();
            assert_eq!(got, want, "{tag}: exactly the ordinary heads");
            // Every event of the two over-long aggregates is parked, as a candidate of this
            // claim or of the next (never blocked behind one another: no state is kept).
            let mut parked: Vec<_> = b.parked.iter().map(|p| (p.event_id, p.kind)).collect();
            assert_eq!(unkeyable_states(&ctx).await, 0, "{tag}");
            publish_all(&store, &b).await;
            let b = claim(&store, "r", 10).await;
            assert!(b.records.is_empty(), "{tag}");
            parked.extend(b.parked.iter().map(|p| (p.event_id, p.kind)));
            parked.sort_by_key(|p| p.0);
            let mut want_parked: Vec<_> = [&long_id, &long_type, &long_id_next]
                .iter()
                .map(|e| (e.event_id, ParkKind::PermanentError))
                .collect();
            want_parked.sort_by_key(|p| p.0);
            assert_eq!(parked, want_parked, "{tag}");
            store.release(&b.handle).await.unwrap();
            assert_eq!(unkeyable_states(&ctx).await, 0, "{tag}");
            let s = store.stats().await.unwrap();
            assert_eq!((s.parked, s.unpublished, s.blocked), (3, 0, 0), "{tag}");
            for e in [&long_id, &long_type] {
                let err = store.retry_parked(e.event_id, "ops").await.unwrap_err();
                assert_eq!(err.kind, StoreErrorKind::Validation, "{tag}: {err}");
            }
            // The next version: its first version waits below it.
            let err = store
                .retry_parked(long_id_next.event_id, "ops")
                .await
                .unwrap_err();
            assert_eq!(err.kind, StoreErrorKind::Conflict, "{tag}: {err}");
            // Discarded in reverse order: the later version first is refused while the first
            // waits below it, then both go.
            let err = store
                .discard_parked(long_id_next.event_id, "ops", "too long")
                .await
                .unwrap_err();
            assert_eq!(err.kind, StoreErrorKind::Conflict, "{tag}: {err}");
            for e in [&long_id, &long_id_next, &long_type] {
                store
                    .discard_parked(e.event_id, "ops", "too long")
                    .await
                    .unwrap();
            }
            assert_eq!(unkeyable_states(&ctx).await, 0, "{tag}");
            let s = store.stats().await.unwrap();
            assert_eq!((s.parked, s.unpublished), (0, 0), "{tag}");
            // The aggregate at the bound has its state, and its next version flows.
            let next = ev(&at_bound, &id_at_bound, first + 1);
            store.append(&ctx.pool, &next).await.unwrap();
            let b = claim(&store, "r", 10).await;
            assert_eq!(b.records.len(), 1, "{tag}");
            assert_eq!(b.records[0].envelope.event_id, next.event_id, "{tag}");
            publish_all(&store, &b).await;
        }
    }
    ctx.drop().await;
}
