//! Aggregate names against the index limit of the per-aggregate state (issue 20, item 6):
//! `aggregate_type` and `aggregate_id` of up to `MAX_AGGREGATE_NAME_BYTES` bytes each flow in
//! both claim modes, through every write of the state row (claim, completion, operator
//! retry); longer ones are refused at append even with raised name limits; a stored event past
//! the limit (written by other means, or by a version without the bound) is parked alone and
//! never stops the claims of other aggregates. Names are random printable characters, so
//! PostgreSQL cannot compress them below the limit.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, Envelope, EnvelopeLimits, ParkKind, StoreErrorKind, MAX_AGGREGATE_NAME_BYTES,
};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::store_checks;
use rand::{Rng, SeedableRng};

use common::{claim, lease, park, publish_all};

/// `n` random printable ASCII characters (seeded).
fn name(seed: u64, n: usize) -> String {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(b'!'..=b'~') as char)
        .collect()
}

fn raised(ctx: &common::Ctx, mode: ClaimMode) -> PostgresOutboxStore {
    PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .limits(EnvelopeLimits::default().with_max_name_len(8192))
        .build()
        .unwrap()
}

fn ev(limits: &EnvelopeLimits, agg_type: &str, agg_id: &str, version: i64) -> Envelope {
    Envelope::builder(agg_type, agg_id, version, "order.changed")
        .limits(limits.clone())
        .json(&serde_json::json!({ "v": version }))
        .unwrap()
        .build()
        .unwrap()
}

const MODES: [&str; 2] = ["lease", "locked"];

fn mode(m: &str) -> ClaimMode {
    match m {
        "lease" => lease(30.0),
        _ => ClaimMode::LockedTransaction,
    }
}

/// At the limit: both names of exactly `MAX_AGGREGATE_NAME_BYTES` bytes, in both modes,
/// through a claim, a publication, a park and an operator retry (each writes the state row).
#[tokio::test]
async fn aggregate_names_at_the_limit_flow_in_both_modes() {
    let ctx = ctx!(4);
    for (i, m) in MODES.iter().enumerate() {
        let store = raised(&ctx, mode(m));
        store.migrate().await.unwrap();
        let limits = EnvelopeLimits::unlimited();
        let (t, id) = (
            name(2 * i as u64, MAX_AGGREGATE_NAME_BYTES),
            name(2 * i as u64 + 1, MAX_AGGREGATE_NAME_BYTES),
        );
        let (v1, v2) = (ev(&limits, &t, &id, 1), ev(&limits, &t, &id, 2));
        store
            .append_many(&ctx.pool, &[v1.clone(), v2.clone()])
            .await
            .unwrap();
        let b = claim(&store, m, 10).await;
        assert_eq!(b.records.len(), 1, "{m}");
        assert_eq!(b.records[0].envelope.event_id, v1.event_id, "{m}");
        publish_all(&store, &b).await;
        let b = claim(&store, m, 10).await;
        assert_eq!(b.records[0].envelope.event_id, v2.event_id, "{m}");
        let rep = store.complete(&b.handle, &[park(&v2)]).await.unwrap();
        assert_eq!(rep.applied, 1, "{m}");
        store.retry_parked(v2.event_id, "ops").await.unwrap();
        let b = claim(&store, m, 10).await;
        assert_eq!(b.records[0].envelope.event_id, v2.event_id, "{m}");
        publish_all(&store, &b).await;
        let last: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT last_version FROM \"{}\".outbox_events_aggregate WHERE aggregate_id = $1",
            ctx.schema
        ))
        .bind(&id)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(last, Some(2), "{m}");
    }
    ctx.drop().await;
}

// FOUND (issue 20, item 6, reproduced): with a raised name limit an aggregate id past about
// 2.7 kB was accepted at append, and its state row could not be indexed. Now each aggregate
// name is bounded to MAX_AGGREGATE_NAME_BYTES whatever max_name_len allows (one byte past it
// is refused, and nothing of the call is written), and a store is not built with a larger
// bound.
#[tokio::test]
async fn aggregate_names_past_the_limit_are_refused_at_append() {
    let ctx = ctx!(4);
    let store = raised(&ctx, lease(30.0));
    store.migrate().await.unwrap();
    let limits = EnvelopeLimits::unlimited();
    let ok = ev(&limits, "order", "fine", 1);
    for (t, id) in [
        (name(1, MAX_AGGREGATE_NAME_BYTES + 1), "a".to_owned()),
        ("order".to_owned(), name(2, MAX_AGGREGATE_NAME_BYTES + 1)),
        ("order".to_owned(), name(3, 2700)),
    ] {
        let err = store
            .append_many(&ctx.pool, &[ok.clone(), ev(&limits, &t, &id, 1)])
            .await
            .expect_err("an aggregate name past the limit was accepted");
        assert_eq!(err.kind, StoreErrorKind::Validation, "{err}");
    }
    let rows: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(rows, 0, "nothing of a refused call is written");
    let mut above = EnvelopeLimits::default();
    above.max_aggregate_name_bytes = MAX_AGGREGATE_NAME_BYTES + 1;
    let err = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .limits(above)
        .build()
        .expect_err("limits no store can key were accepted");
    assert_eq!(err.kind, StoreErrorKind::Configuration, "{err}");
    ctx.drop().await;
}

// FOUND (issue 20, item 6, reproduced): a stored event whose aggregate id is about 2.7 kB (an
// earlier version accepted it under raised limits) made every lease claim fail (its state row
// could not be indexed, and the claim writes the state rows of all its heads in one
// statement), and in locked mode every completion of a batch holding it: no aggregate was
// published. Now the claim parks it, and its later versions, as permanent errors before
// writing any state; the others flow; it can be discarded, not retried or re-issued.
#[tokio::test]
async fn a_stored_event_past_the_limit_is_parked_and_never_stops_other_claims() {
    let ctx = ctx!(4);
    for (i, m) in MODES.iter().enumerate() {
        let store = ctx.store(mode(m)).await;
        let long_id = name(10 + i as u64, 2700);
        let unlimited = EnvelopeLimits::unlimited();
        let (l1, l2) = (
            ev(&unlimited, "order", &long_id, 1),
            ev(&unlimited, "order", &long_id, 2),
        );
        for e in [&l1, &l2] {
            sqlx::query(&format!(
                "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
                   aggregate_version, event_type, schema_version, content_type, payload, \
                   created_at) VALUES ($1, $2, $3, $4, $5, 1, 'application/json', $6, now())",
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
        let others: Vec<Envelope> = (0..3)
            .map(|k| common::event(&format!("{m}-ok-{k}"), 1))
            .collect();
        store.append_many(&ctx.pool, &others).await.unwrap();

        let b = claim(&store, m, 10).await;
        let got: Vec<_> = b.records.iter().map(|r| r.envelope.event_id).collect();
        assert_eq!(
            got,
            others.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            "{m}: the other aggregates are claimed"
        );
        assert!(
            b.parked
                .iter()
                .any(|p| p.event_id == l1.event_id && p.kind == ParkKind::PermanentError),
            "{m}: the claim reports the event it parked: {:?}",
            b.parked
        );
        publish_all(&store, &b).await;
        // Its version 2, reached by the next claim, is parked too; nothing is claimable.
        let b = claim(&store, m, 10).await;
        assert!(b.records.is_empty(), "{m}");
        store_checks::unkeyable_pair_can_only_be_discarded(
            &store,
            [l1.event_id, l2.event_id],
            MAX_AGGREGATE_NAME_BYTES,
            m,
        )
        .await;
    }
    ctx.drop().await;
}
